"""`pykvq calibrate`: choose the kivi sinks count, the rotation, SKVQ's clip ratios (each part's choice held against
its runner-up on held-out text, pykvq.calibration.clip_choice) and the fp16 window, find each
layer's K and V sensitivity on a text (from the f16 run's attention, or measured one tensor at a time), choose
per-layer widths for a budget, refine them by measuring mixes (pykvq.calibration.mix_cost ranks them), check the
refined mix against kivi2 everywhere on held-out text (pykvq.calibration.held_out), choose V's dithered rounding for
the finished mix, and write them into a copy of the model as kvq.* metadata. The choices from
measurements live in pykvq.calibration; the model runs here.

Every choice is judged by the KL divergence against f16 KV of a probe: the text's first tokens, then (the recall
span) a stretch of the text from its start repeated, so that those tokens are predicted by copying from further
back than the fp16 window. Prose alone rarely needs the exact recall of a distant token, which a pass key does; the
divergence is the mean of the text's and the recall span's, weighed alike. The mixes the refinement measures are
judged on pass-key prompts too (--retrieval, pykvq.calibration.retrieval), which the probe cannot see.

Under multi-head latent attention the cache holds K alone and reads V, K's first channels, from its tiles: K's widths
and clip ratios are chosen (its error counting V's), the budget is K's, and nothing that acts on V rows (rotation,
V's dither, V clip ratios, selection) is measured or taken."""

from __future__ import annotations

import argparse
import logging
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pykvq import gguf_metadata, kv_types, output_path
from pykvq.calibration import (attention_scale, attention_sensitivity, clip_ratios, dither_choice, held_out, retrieval,
                               rotation, window_choice)
from pykvq.calibration.allocation import (BITS, PARTS, Allocation, Refinement, Sensitivity, allocate, budget_argument,
                                          format_allocation, refine)
from pykvq.calibration.attention_sensitivity import WidthErrors
from pykvq.calibration.clip_choice import ClipChoice, HeldOutClip, Ratios, check_held_out, choose_clip
from pykvq.calibration.dither_choice import DitherChoice, choose_dither
from pykvq.calibration.held_out import HeldOutCheck
from pykvq.calibration.mix_cost import MixCost
from pykvq.calibration.window_choice import WindowChoice
from pykvq.api.capture import AttentionCapture, TensorObserver
from pykvq.api.llama import ContextConfig, KvConfig, Model
from pykvq.bindings import native
from pykvq.commands import arguments
from pykvq.commands import inspect as model_info
from pykvq.input_files import check_readable_file

log = logging.getLogger("pykvq.calibrate")

# Each tensor is probed one width up and one down from kivi2 everywhere: budgets around 2 bits, where the
# choice matters most, land near that point, and costs measured around it add up best there.
PROBED = ("kivi4", "kivi1")
REFERENCE = attention_sensitivity.REFERENCE
SENSITIVITY_SOURCES = ("attention", "measured")
# Sinks (first tokens kept in fp16) cost a few fp16 cells, yet on some models they decide whether 2-bit K keeps
# attention sinks intact: the fewest whose KL divergence is within SINKS_TOLERANCE of the best count's
SINK_CANDIDATES = (0, 1, 2, 4, 8)
SINKS_TOLERANCE = 0.02
# the recalled stretch starts past every sinks candidate, so that the cache holds all of it quantized
RECALL_START = max(SINK_CANDIDATES)
# SmolLM2's pass-key loss shows in the answer's divergence after 1024 tokens, not after 512
RETRIEVAL_CTX = 1024


@dataclass(frozen=True)
class Probe:
    """How the sensitivities are measured: the first n_tokens of a text, the kivi window and sinks used."""

    n_tokens: int
    window: int
    sinks: int
    threads: int
    clip: str = "none"      # SKVQ's clip ratios while measuring, the --kv-clip form
    rotate: str = "off"     # the Hadamard rotation while measuring, the --kv-rotate form
    recall: int = 0         # the last n_tokens: the text from RECALL_START again (0: the text alone)
    dither: str = "none"    # V's dithered rounding while measuring, the --kv-dither form
    op_offload: bool = True  # --op-offload: host tensor operations offloaded to the GPU
    kv_offload: bool = True  # -nkvo turns it off: the KV cache in host memory

    def __post_init__(self) -> None:
        """ValueError unless the recall span reads tokens that the cache holds quantized (past the fp16 window and
        the query's own tile)."""
        if self.recall < 0 or self.recall >= self.n_tokens:
            raise ValueError(f"--recall {self.recall}: give 0 (none) up to fewer than the -c {self.n_tokens} tokens")
        if not self.recall_clears(self.window):
            raise ValueError(f"--recall {self.recall} with -c {self.n_tokens}: the recalled tokens would lie "
                             f"{self.recall_distance} tokens back, within the {self.window}-token fp16 window and a "
                             f"{clip_ratios.GROUP}-token tile; lower --recall or raise -c")

    @property
    def recall_distance(self) -> int:
        """How far back the recall span reads its tokens."""
        return self.n_tokens - self.recall - RECALL_START

    def recall_clears(self, window: int) -> bool:
        """Whether the recall span (if any) reads past a window of ``window`` tokens and the query's tile."""
        return not self.recall or self.recall_distance >= window + clip_ratios.GROUP

    def window_candidates(self) -> list[int]:
        """The windows window_choice weighs that this probe can judge: the recall span reads past them, and
        some tokens lie past the longest and its tile; ValueError when none."""
        group = clip_ratios.GROUP
        out = [w for w in window_choice.CANDIDATES if self.recall_clears(w) and w + group < self.n_tokens]
        if not out:
            raise ValueError(f"-c {self.n_tokens} is too short to choose a window among "
                             f"{', '.join(map(str, window_choice.CANDIDATES))}: raise -c or give --kv-window")
        return out

    def tokens(self, text: list[int]) -> list[int]:
        """The probe's tokens from the text's: its first n_tokens - recall, then its recall span again."""
        return text[:self.n_tokens - self.recall] + text[RECALL_START:RECALL_START + self.recall]

    def weights(self) -> np.ndarray:
        """Each probe token's weight in the mean divergence: the text's and the recall span's halves alike."""
        n_text = self.n_tokens - self.recall
        if not self.recall:
            return np.full(n_text, 1.0 / n_text)
        return np.concatenate([np.full(n_text, 0.5 / n_text), np.full(self.recall, 0.5 / self.recall)])

    def prose_weights(self) -> np.ndarray:
        """Each probe token's weight in the text's own mean divergence (the recall span's tokens weigh nothing)."""
        n_text = self.n_tokens - self.recall
        return np.concatenate([np.full(n_text, 1.0 / n_text), np.zeros(self.recall)])


def widest_context(probe: Probe, retrieval_ctx: int) -> ContextConfig:
    """The largest context a calibration creates (the f16 reference over the probe in one ubatch, or a pass-key
    prompt of retrieval_ctx tokens): the model is placed where that one fits."""
    n = max(probe.n_tokens, retrieval_ctx)
    return ContextConfig(n_ctx=n, n_batch=n, n_ubatch=n, n_threads=probe.threads, flash_attn="on",
                         kv=KvConfig(layers="none"), op_offload=probe.op_offload, kv_offload=probe.kv_offload)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def mean_kld(reference: np.ndarray, other: np.ndarray, weights: np.ndarray) -> float:
    """The weighted mean over tokens of KL(reference || other), both given as log-probabilities."""
    return float(np.dot(weights, np.sum(np.exp(reference) * (reference - other), axis=1)))


def uniform_types(layers: list[int], **by_part: str) -> dict[tuple[str, int], str]:
    """Each part's one type in every layer (the reference where a part is not given)."""
    return {(part, il): by_part.get(part, REFERENCE) for part in PARTS for il in layers}


class Calibrator:
    """Log-probabilities of the probe's tokens (from a text's, Probe.tokens) under different KV layer mixes, against
    f16 KV; the Q, K and V every layer attends with in the f16 run (one ubatch); the first answer token's
    log-probabilities of pass-key prompts (``retrieval``: token lists, none to leave them out)."""

    def __init__(self, model: Model, text: list[int], probe: Probe, retrieval: list[list[int]] | None = None) -> None:
        self.model = model
        self.tokens = probe.tokens(text)
        self.probe = probe
        self.weights = probe.weights()
        self.capture = AttentionCapture(len(self.tokens))
        self.reference = self._log_probs(self.tokens, KvConfig(layers="none"), self.capture)
        # what is calibrated: the layers the cache holds (not a hybrid's recurrent ones, nor those reading an
        # earlier layer's cache)
        self.layers = self.capture.kv_layers()
        if not self.layers:
            raise ValueError("no layer of the model attends with K and V of its own: it keeps no KV cache to "
                             "calibrate")
        # multi-head latent attention: V is K's first channels, which the cache reads from K's tiles; K alone has
        # widths and clip ratios to choose
        latent = [il for il in self.layers if clip_ratios.is_latent(*self.capture.layer(il)[1:])]
        if latent and latent != self.layers:
            raise ValueError(f"layers {latent} attend with multi-head latent attention and the others with K and V of "
                             "their own: pykvq calibrate does not weigh such a mix")
        self.parts = ("k",) if latent else PARTS
        self.scales = {il: attention_scale.layer_scale(*self.capture.layer(il), self.capture.output(il), model.n_swa)
                       for il in tqdm(self.layers, unit="layer", desc="attention scales")}
        self.retrieval = retrieval or []
        self.retrieval_reference = [self._log_probs(p, KvConfig(layers="none"), last_only=True)
                                    for p in tqdm(self.retrieval, unit="prompt", desc="pass-key reference",
                                                  disable=not self.retrieval)]

    def _log_probs(self, tokens: list[int], kv: KvConfig, observer: TensorObserver | None = None,
                   last_only: bool = False) -> np.ndarray:
        n = len(tokens)
        config = ContextConfig(n_ctx=n, n_batch=n, n_ubatch=n if observer is not None else ContextConfig.n_ubatch,
                               n_threads=self.probe.threads, flash_attn="on", kv=kv, observer=observer,
                               op_offload=self.probe.op_offload, kv_offload=self.probe.kv_offload)
        with self.model.context(config) as ctx:
            return log_softmax(np.atleast_2d(ctx.eval(tokens, all_logits=not last_only)))

    def _kv(self, layers: str, sinks: int | None = None, clip: str | None = None, rotate: str | None = None,
            window: int | None = None, dither: str | None = None) -> KvConfig:
        # a copy calibrated again keeps its kvq.select out of the measurement (one whole prompt either way)
        return KvConfig(REFERENCE, REFERENCE, self.probe.window if window is None else window,
                        self.probe.sinks if sinks is None else sinks,
                        rotate=self.probe.rotate if rotate is None else rotate, layers=layers,
                        clip=self.probe.clip if clip is None else clip, select=kv_types.SELECT_OFF,
                        dither=self.probe.dither if dither is None else dither)

    def kld(self, layers: str, sinks: int | None = None, clip: str | None = None, rotate: str | None = None,
            window: int | None = None, weights: np.ndarray | None = None, dither: str | None = None) -> float:
        """KL divergence against f16 KV of a per-layer mix, with the probe's sinks, clip ratios, rotation, window,
        token weights and V dither or those given."""
        kv = self._kv(layers, sinks, clip, rotate, window, dither)
        return mean_kld(self.reference, self._log_probs(self.tokens, kv), self.weights if weights is None else weights)

    def retrieval_kld(self, layers: str, clip: str, dither: str | None = None) -> float | None:
        """Mean over the pass-key prompts of the KL divergence against f16 KV at the answer's first token (None
        without prompts)."""
        kv = self._kv(layers, clip=clip, dither=dither)
        klds = [mean_kld(ref, self._log_probs(p, kv, last_only=True), np.ones(1))
                for p, ref in zip(self.retrieval, self.retrieval_reference, strict=True)]
        return float(np.mean(klds)) if klds else None

    def captured(self, il: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Layer il's captured Q, K and V, Q carrying what the layer's attention scale adds to head_dim^-0.5 (which
        the attention model applies); None where the cache holds no K and V of the layer."""
        if il not in self.layers:
            return None
        q, k, v = self.capture.layer(il)
        return q * np.float32(self.scales[il] * math.sqrt(q.shape[-1])), k, v

    def layer_qkv(self, il: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Layer il's captured Q, K and V as the cache takes them under the probe's rotation."""
        rotate_k, rotate_v = native.resolve_rotation(self.probe.rotate, self.model.n_layer)
        return rotation.rotated_layer(self.captured, {"k": rotate_k, "v": rotate_v})(il)

    def rotation_klds(self) -> dict[str, float]:
        """KL divergence of kivi2 everywhere (the probe's clip ratios) without rotation, with the per-layer rotation
        of least attention-output error (pykvq.calibration.rotation), and with every layer rotated."""
        with tqdm(total=self.model.n_layer, unit="layer", desc="rotation") as progress:
            per_layer = rotation.per_layer_rotation(self.captured, self.model.n_layer, self.probe.window,
                                                    self.probe.sinks, progress.update)
        return {spec: self.kld("none", rotate=spec) for spec in dict.fromkeys(("off", per_layer, "on"))}

    def sinks_klds(self, candidates: tuple[int, ...]) -> dict[int, float]:
        """KL divergence of kivi2 everywhere with each sinks count."""
        return {n: self.kld("none", n) for n in tqdm(candidates, unit="count", desc="sinks")}

    def window_choice(self, target_ctx: int) -> WindowChoice:
        """kivi2 everywhere at each candidate window the probe allows, and the price of a bit per element (kivi4
        everywhere, unclipped, at the probe's window), over the tokens past every candidate (window_choice)."""
        candidates = self.probe.window_candidates()
        weights = window_choice.scored_from(self.weights, max(candidates) + clip_ratios.GROUP)
        n_layer = self.model.n_layer
        dearer = Allocation(uniform_types(self.layers, k=window_choice.DEARER, v=window_choice.DEARER), n_layer, 0.0)
        with tqdm(total=len(candidates) + 1, unit="run", desc="window") as progress:
            klds = {}
            for w in candidates:
                klds[w] = self.kld("none", window=w, weights=weights)
                progress.update()
            cheaper = klds.get(self.probe.window)
            if cheaper is None:
                cheaper = self.kld("none", weights=weights)
            kld_dearer = self.kld(dearer.spec(), clip="none", weights=weights)
            progress.update()
        sinks = self.probe.sinks
        return WindowChoice(target_ctx, klds, window_choice.window_bits(candidates, sinks, target_ctx),
                            window_choice.kld_per_bit(cheaper, kld_dearer, self.probe.window, sinks, target_ctx))

    def clip_choice(self) -> ClipChoice:
        """kivi2's clip ratios per part, each candidate measured by the cache's KL divergence (clip_choice): the
        per-layer ones from the f16 run's Q, K and V (clip_ratios) among them."""
        with tqdm(total=self.model.n_layer, unit="layer", desc="clip ratios") as progress:
            per_layer = clip_ratios.per_layer_ratios(self.layer_qkv, self.model.n_layer, self.probe.window,
                                                     self.probe.sinks, progress=progress.update)
        with tqdm(unit="run", desc="clip") as progress:
            return choose_clip(lambda ratios: self.kld("none", clip=clip_ratios.clip_spec_per_layer(ratios)),
                               per_layer, progress=progress.update, parts=self.parts)

    def width_errors(self, ratios: tuple[float, ...] | None = clip_ratios.RATIOS) -> list[WidthErrors]:
        """Each layer's K and V attention-output error and clip ratio per width (attention_sensitivity):
        kivi2 at the probe's ratios, the other widths at their best among ``ratios`` (None: the probe's too)."""
        n_layer = self.model.n_layer
        k_clip, v_clip = native.resolve_clip(self.probe.clip, n_layer)
        with tqdm(total=n_layer, unit="layer", desc="attention errors") as progress:
            return attention_sensitivity.width_errors(self.layer_qkv, n_layer, self.probe.window, self.probe.sinks,
                                                      {"k": k_clip, "v": v_clip}, ratios, progress.update)

    def _mix(self, types: dict[tuple[str, int], str], widths: list[WidthErrors]) -> tuple[str, str]:
        """A mix's --kv-layers spec and its --kv-clip, each tensor clipped at its width's ratio."""
        n_layer = self.model.n_layer
        return Allocation(types, n_layer, 0.0).spec(), attention_sensitivity.clip_spec(widths, types, n_layer)

    def mix_kld(self, types: dict[tuple[str, int], str], widths: list[WidthErrors]) -> float:
        """KL divergence of a mix, each tensor clipped at its width's ratio."""
        layers, clip = self._mix(types, widths)
        return self.kld(layers, clip=clip)

    def mix_cost(self, types: dict[tuple[str, int], str], widths: list[WidthErrors], dither: str | None = None,
                 prose_limit: float | None = None) -> MixCost:
        """What the refinement weighs (pykvq.calibration.mix_cost): a mix's KL divergence on the probe, on its text
        alone and at the pass-key answers, with the probe's V dither or ``dither``."""
        layers, clip = self._mix(types, widths)
        log_probs = self._log_probs(self.tokens, self._kv(layers, clip=clip, dither=dither))
        return MixCost(mean_kld(self.reference, log_probs, self.weights),
                       mean_kld(self.reference, log_probs, self.probe.prose_weights()),
                       self.retrieval_kld(layers, clip, dither), prose_limit)

    def held_out_klds(self, stretches: list[list[int]], kvs: list[KvConfig], desc: str) -> list[float]:
        """Each cache's KL divergence against f16 KV over the stretches (each one context, every token alike)."""
        totals = np.zeros(len(kvs))
        with tqdm(total=len(stretches) * (1 + len(kvs)), unit="run", desc=desc) as progress:
            for tokens in stretches:
                reference = self._log_probs(tokens, KvConfig(layers="none"))
                progress.update()
                weights = np.full(len(tokens), 1.0 / len(tokens))
                for i, kv in enumerate(kvs):
                    totals[i] += mean_kld(reference, self._log_probs(tokens, kv), weights)
                    progress.update()
        return [float(t) for t in totals / len(stretches)]

    def held_out_mix_klds(self, stretches: list[list[int]], mixes: list[dict[tuple[str, int], str]],
                          widths: list[WidthErrors]) -> list[float]:
        """Each mix's KL divergence against f16 KV over the stretches, each tensor clipped at its width's ratio."""
        mixed = [self._mix(types, widths) for types in mixes]
        return self.held_out_klds(stretches, [self._kv(layers, clip=clip) for layers, clip in mixed], "held-out check")

    def held_out_clip(self, stretches: list[list[int]], choice: ClipChoice) -> HeldOutClip:
        """The clip choice held against each part's runner-up over the stretches (clip_choice.check_held_out), kivi2
        everywhere."""
        return check_held_out(choice, lambda candidates: self.held_out_klds(
            stretches, [self._kv("none", clip=clip_ratios.clip_spec_per_layer(r)) for r in candidates],
            "clip held-out check"))

    def held_out_stretches(self, text: list[int]) -> list[list[int]]:
        """The text's stretches of the probe's length after the probe's text (pykvq.calibration.held_out)."""
        return held_out.stretches(text, self.probe.n_tokens - self.probe.recall, self.probe.n_tokens)

    def dither_choice(self, types: dict[tuple[str, int], str], widths: list[WidthErrors],
                      prose_limit: float | None) -> DitherChoice[MixCost]:
        """The finished mix's cost with its low-bit V layers at each candidate spread (dither_choice), ranked as the
        mixes are (within ``prose_limit`` first)."""
        types_v = [types.get(("v", il), REFERENCE) for il in range(self.model.n_layer)]
        with tqdm(total=len(dither_choice.SPREADS), unit="run", desc="V dither") as progress:
            return choose_dither(types_v, lambda spec: self.mix_cost(types, widths, spec, prose_limit),
                                 progress.update)

    def attention_sensitivities(self, widths: list[WidthErrors]) -> list[Sensitivity]:
        """The attention errors in KL divergence: each part's scale from one measured mix, that part kivi2 and the
        other kivi4 everywhere."""
        other = {"k": "v", "v": "k"}
        scale = {}
        for part in tqdm(self.parts, unit="part", desc="error scale"):
            kld = self.mix_kld(uniform_types(self.layers, **{part: REFERENCE, other[part]: "kivi4"}), widths)
            scale[part] = attention_sensitivity.kld_scale(widths, part, kld)
        return attention_sensitivity.sensitivities(widths, scale)

    def measured_sensitivities(self, widths: list[WidthErrors]) -> list[Sensitivity]:
        """Each tensor one width up and one down from kivi2 everywhere, measured as a whole mix."""
        everywhere = uniform_types(self.layers)
        base = self.mix_kld(everywhere, widths)
        out = []
        with tqdm(total=len(self.parts) * len(self.layers) * len(PROBED), unit="probe", desc="calibrate") as progress:
            for part in self.parts:
                for layer in self.layers:
                    cost = {REFERENCE: 0.0}
                    for name in PROBED:
                        progress.set_postfix_str(f"{part}{layer} {name}")
                        cost[name] = self.mix_kld({**everywhere, (part, layer): name}, widths) - base
                        progress.update()
                    out.append(Sensitivity(part, layer, cost))
        return out


def choose_sinks(klds: dict[int, float]) -> int:
    """The fewest sinks whose KL divergence is within SINKS_TOLERANCE of the best."""
    best = min(klds.values())
    return min(n for n, kld in klds.items() if kld <= best * (1 + SINKS_TOLERANCE))


def refined(calibrator: Calibrator, additive: Allocation, sensitivities: list[Sensitivity], budget: float,
            max_evaluations: int, widths: list[WidthErrors]) -> tuple[Refinement[MixCost], dict[str, MixCost]]:
    """Up to ``max_evaluations`` mixes measured (allocation.refine) from the better of the additive choice and, where
    the budget affords it, kivi2 everywhere, whose prose divergence is then the limit (pykvq.calibration.mix_cost);
    every measured mix's cost by its --kv-layers spec."""
    costs: dict[str, MixCost] = {}
    limit = None

    def measure(allocation: Allocation) -> MixCost:
        spec = allocation.spec()
        if spec not in costs:
            costs[spec] = calibrator.mix_cost(allocation.types, widths, prose_limit=limit)
        return costs[spec]

    start = additive
    limited = budget >= BITS[REFERENCE]
    with tqdm(total=1 + limited + max_evaluations, unit="mix", desc="refine") as progress:
        if limited:
            everywhere = kivi2_everywhere(additive)
            reference = calibrator.mix_cost(everywhere.types, widths)
            limit = reference.prose
            costs[everywhere.spec()] = replace(reference, prose_limit=limit)
            progress.update()
            start = min(additive, everywhere, key=measure)
        return refine(start, sensitivities, budget, measure, 1 + max_evaluations, progress.update), costs


def kivi2_everywhere(allocation: Allocation) -> Allocation:
    """kivi2 in every tensor the allocation holds."""
    return Allocation(dict.fromkeys(allocation.types, REFERENCE), allocation.n_layer, 0.0)


def no_held_out_words(probe: Probe, what: str) -> str:
    return (f"the text holds no {probe.n_tokens} tokens after the probe's: {what} is not checked on held-out text (a "
            "longer text gets the check)")


def checked_clip(calibrator: Calibrator, text: list[int], choice: ClipChoice) -> Ratios:
    """The clip choice after its held-out check (clip_choice.check_held_out), or as the probe made it where the text
    holds no held-out stretch or no part had a runner-up."""
    stretches = calibrator.held_out_stretches(text)
    if not stretches:
        print(no_held_out_words(calibrator.probe, "the clip choice"))
        return choice.chosen
    if not choice.runners_up:
        return choice.chosen
    checked = calibrator.held_out_clip(stretches, choice)
    print(format_held_out_clip(checked, len(stretches) * calibrator.probe.n_tokens) + f" -> --kv-clip '{checked.spec}'")
    return checked.chosen


def checked_mix(calibrator: Calibrator, text: list[int], result: Refinement[MixCost],
                widths: list[WidthErrors]) -> tuple[Allocation, HeldOutCheck | None]:
    """The refined mix, or kivi2 everywhere where it is lower over the text's stretches of the probe's length after the
    probe's text (pykvq.calibration.held_out); the check, None where none ran: without a prose limit (kivi2 everywhere
    over the budget), when the mix is kivi2 everywhere, or when the text ends before the first stretch."""
    allocation = result.allocation
    everywhere = kivi2_everywhere(allocation)
    if result.measured.prose_limit is None or allocation.spec() == everywhere.spec():
        return allocation, None
    stretches = calibrator.held_out_stretches(text)
    if not stretches:
        print(no_held_out_words(calibrator.probe, "the refined mix"))
        return allocation, None
    mix, kivi2 = calibrator.held_out_mix_klds(stretches, [allocation.types, everywhere.types], widths)
    check = HeldOutCheck(len(stretches) * calibrator.probe.n_tokens, mix, kivi2)
    print(check)
    return (allocation if check.keeps_mix else everywhere), check


def per_width_clip_fields(widths: list[WidthErrors], layers: list[int], n_layer: int) -> dict[str, str]:
    """kvq.calibration.kivi4_clip and kivi1_clip: every tensor the cache holds at that width's ratio, which a cache
    whose types are not the copy's takes (pykvq.width_clips)."""
    return {key: attention_sensitivity.clip_spec(widths, uniform_types(layers, k=name, v=name), n_layer)
            for name, key in gguf_metadata.WIDTH_CLIP_KEYS.items() if name != REFERENCE}


def metadata(allocation: Allocation, clip: str, budget: float, sensitivities: list[Sensitivity], source: str,
             text: Path, probe: Probe, window: WindowChoice | None,
             retrieval_probe: retrieval.RetrievalProbe | None, check: HeldOutCheck | None) -> dict[str, object]:
    record: dict[str, object] = {
        **gguf_metadata.allocation_fields(allocation.spec(), budget),
        gguf_metadata.KEY_SENSITIVITY: source,
        "kvq.calibration.text": text.name,
        "kvq.calibration.n_tokens": probe.n_tokens,
        gguf_metadata.KEY_RECALL: probe.recall,
        "kvq.calibration.retrieval": retrieval_probe.n_keys if retrieval_probe else 0,
        "kvq.calibration.retrieval_ctx": retrieval_probe.n_tokens if retrieval_probe else 0,
        "kvq.calibration.window": probe.window,
        "kvq.calibration.sinks": probe.sinks,
        "kvq.calibration.held_out": check.n_tokens if check else 0,
        gguf_metadata.KEY_KIVI2_CLIP: probe.clip,
        gguf_metadata.KEY_SINKS: probe.sinks,
        gguf_metadata.KEY_WINDOW: probe.window,
    }
    if check is not None:
        record["kvq.calibration.held_out_kld"] = [check.mix, check.everywhere]
    if window is not None:
        record[gguf_metadata.KEY_WINDOW_CTX] = window.target_ctx
    if clip != "none":
        record[gguf_metadata.KEY_CLIP] = clip
    if probe.rotate != "off":
        record[gguf_metadata.KEY_ROTATE] = probe.rotate
    if probe.dither != "none":
        record[gguf_metadata.KEY_DITHER] = probe.dither
    costs = {(s.part, s.layer): s.cost for s in sensitivities}
    for part in PARTS:
        for name in PROBED:
            # 0 in the layers the cache does not hold: their width changes nothing
            record[f"kvq.calibration.kld_{part}_{name}"] = [costs[part, il][name] if (part, il) in costs else 0.0
                                                            for il in range(allocation.n_layer)]
    return record


def run(args: argparse.Namespace) -> int:
    probe = checked_probe(args)
    with output_path.new_output(args.output, (("the model", args.model), ("the calibration text", args.file))):
        calibrate(args, probe)
    print(f"wrote {args.output}")
    return 0


def checked_probe(args: argparse.Namespace) -> Probe:
    """The probe the arguments ask for; FileNotFoundError or ValueError, before any model work, for arguments that
    could not make a calibration (or would be silently ignored by it)."""
    for f, what in ((args.model, "model"), (args.file, "calibration text")):
        check_readable_file(f, what)
    # from the header: llama.cpp would refuse a kvq.version it does not read at the first context, with a hint for
    # run (--kv-clip none) that calibrate cannot take
    gguf_metadata.read_kvq(args.model)
    # first: --recall's default and the window's checks are taken from it
    if args.ctx_size < 1:
        raise ValueError(f"-c {args.ctx_size}: give the number of calibration tokens (512 by default)")
    if args.threads < 1:
        raise ValueError(f"-t {args.threads}: give 1 thread or more")
    if args.refine < 0:
        raise ValueError(f"--refine {args.refine}: the number of mixes to measure is 0 or more")
    if args.retrieval < 0:
        raise ValueError(f"--retrieval {args.retrieval}: the number of pass-key prompts is 0 or more")
    if args.retrieval and not args.refine:
        raise ValueError("--retrieval judges the refined mixes: give --refine 1 or more")
    if args.retrieval_ctx is not None and not args.retrieval:
        raise ValueError("--retrieval-ctx sizes the pass-key prompts of --retrieval N: give --retrieval with it")
    if args.kv_budget < min(BITS.values()):
        raise ValueError(f"--kv-budget {args.kv_budget:g} is below what any mix reaches (1 bit: kivi1 everywhere)")
    if args.kv_budget > max(BITS.values()):
        raise ValueError(f"--kv-budget {args.kv_budget:g} is above what any mix spends (4 bits: kivi4 everywhere, "
                         "a budget of 4 or less)")
    if args.kv_window_ctx is not None and args.kv_window_ctx < 1:
        raise ValueError(f"--kv-window-ctx {args.kv_window_ctx}: give the context length the model will run at")
    if args.kv_window_ctx is not None and args.kv_window != "auto":
        raise ValueError("--kv-window-ctx prices the windows --kv-window auto weighs: give --kv-window auto with it")
    clip = "none" if args.kv_clip == "auto" else args.kv_clip
    rotate = "off" if args.kv_rotate == "auto" else args.kv_rotate
    recall = args.ctx_size // 4 if args.recall is None else args.recall
    window = native.kvq_default_params().window if args.kv_window in (None, "auto") else args.kv_window
    dither = "none" if args.kv_dither == "auto" else args.kv_dither
    probe = Probe(args.ctx_size, window, 0 if args.kv_sinks == "auto" else args.kv_sinks, args.threads, clip, rotate,
                  recall, dither, args.op_offload, args.kv_offload)
    if args.kv_window == "auto":
        probe.window_candidates()
    fewest = clip_ratios.fewest_quantized_tokens(probe.window, probe.sinks)
    if args.kv_sinks != "auto" and probe.n_tokens < fewest:
        raise ValueError(f"--kv-sinks {probe.sinks} with a {probe.window}-token window leaves no token of the "
                         f"-c {probe.n_tokens} probe quantized (it takes {fewest} or more): lower --kv-sinks or "
                         "raise -c")
    return probe


def calibrate(args: argparse.Namespace, probe: Probe) -> None:
    """Measure the model on the text through ``probe``, choose and write the copy (see the module's doc)."""
    clip, rotate, dither = probe.clip, probe.rotate, probe.dither
    windows = None
    n_gpu_layers = arguments.gpu_layers(args, unset=None if args.fit else 999)
    retrieval_ctx = (args.retrieval_ctx or RETRIEVAL_CTX) if args.retrieval else 0
    layers, _ = arguments.fit_to_memory(args, args.model, widest_context(probe, retrieval_ctx), n_gpu_layers)
    with Model(args.model, n_gpu_layers=layers) as model:
        # refused before any measurement, naming the part
        if clip != "none":
            native.resolve_clip(clip, model.n_layer)
        native.resolve_rotation(rotate, model.n_layer)
        native.resolve_dither(dither, model.n_layer)
        latent = model_info.read_shape(gguf_metadata.read_fields(args.model)).latent
        if latent:
            refuse_what_latent_layers_lack(args, clip, rotate, dither, model.n_layer)
        tokens = model.tokenize(args.file.read_text(encoding="utf-8", errors="replace"))
        if len(tokens) < probe.n_tokens:
            raise ValueError(f"the calibration text has {len(tokens)} tokens; -c asks for {probe.n_tokens}")
        retrieval_probe = None
        prompts = None
        if args.retrieval:
            retrieval_probe = retrieval.RetrievalProbe(retrieval_ctx, args.retrieval)
            if retrieval_probe.n_tokens > model.n_ctx_train:
                raise ValueError(f"--retrieval-ctx {retrieval_probe.n_tokens} is longer than the model's training "
                                 f"context ({model.n_ctx_train})")
            prompts = retrieval_probe.prompts(tokens, model.tokenize, probe.window)
        calibrator = Calibrator(model, tokens, probe, prompts)
        if args.kv_sinks == "auto":
            klds = calibrator.sinks_klds(SINK_CANDIDATES)
            probe = calibrator.probe = replace(probe, sinks=choose_sinks(klds))
            print("kivi2 everywhere, KL divergence against f16 KV by sinks: "
                  + ", ".join(f"{n}: {kld:.4f}" for n, kld in klds.items()) + f" -> {probe.sinks} sinks")
        if args.kv_rotate == "auto" and latent:
            print("multi-head latent attention: no rotation (its V, K's first channels, is read from K's tiles) -> "
                  "--kv-rotate off")
        elif args.kv_rotate == "auto":
            klds = calibrator.rotation_klds()
            probe = calibrator.probe = replace(probe, rotate=min(klds, key=klds.__getitem__))
            print("kivi2 everywhere, KL divergence against f16 KV by rotation: "
                  + ", ".join(f"{spec}: {kld:.4f}" for spec, kld in klds.items()) + f" -> --kv-rotate '{probe.rotate}'")
        if args.kv_clip == "auto":
            choice = calibrator.clip_choice()
            print(format_clip_choice(choice) + f" -> --kv-clip '{choice.spec}'")
            chosen = checked_clip(calibrator, tokens, choice)
            probe = calibrator.probe = replace(probe, clip=clip_ratios.clip_spec_per_layer(chosen))
        if args.kv_window == "auto":
            windows = calibrator.window_choice(args.kv_window_ctx or model.n_ctx_train)
            probe = calibrator.probe = replace(probe, window=windows.chosen)
            print(format_window_choice(windows, len(calibrator.tokens)) + f" -> --kv-window {probe.window}")
        # ratios the user gave hold at every width; chosen ones are chosen per width
        widths = calibrator.width_errors(clip_ratios.RATIOS if args.kv_clip == "auto" else None)
        if args.sensitivity == "attention":
            sensitivities = calibrator.attention_sensitivities(widths)
        else:
            sensitivities = calibrator.measured_sensitivities(widths)
        additive = allocate(sensitivities, model.n_layer, args.kv_budget)
        result, costs = refined(calibrator, additive, sensitivities, args.kv_budget, args.refine, widths)
        allocation, check = checked_mix(calibrator, tokens, result, widths)
        if args.kv_dither == "auto" and not latent:
            dithers = calibrator.dither_choice(allocation.types, widths, result.measured.prose_limit)
            probe = replace(probe, dither=dithers.chosen)
            print(format_dither_choice(dithers) + f" -> --kv-dither '{probe.dither}'")
    clip = attention_sensitivity.clip_spec(widths, allocation.types, allocation.n_layer)
    print(format_allocation(allocation))
    print(f"mean code bits {allocation.mean_bits:.3f} (budget {args.kv_budget:g}); KL divergence against f16 KV: "
          f"{costs[additive.spec()]} measured for the additive choice (predicted {additive.predicted_cost:+.4f} from "
          f"kivi2 everywhere), {result.measured} after {result.evaluations - 1} measured mixes"
          + format_prose_limit(result.measured.prose_limit)
          + ("; kivi2 everywhere after the held-out check" if check and not check.keeps_mix else ""))
    print(f"--kv-layers '{allocation.spec()}'")
    print(f"--kv-clip '{clip}' (each tensor at its width's ratio)")
    recorded = metadata(allocation, clip, args.kv_budget, sensitivities, args.sensitivity, args.file, probe,
                        windows, retrieval_probe, check)
    recorded.update(per_width_clip_fields(widths, calibrator.layers, allocation.n_layer))
    if args.kv_select is not None:
        recorded[gguf_metadata.KEY_SELECT] = kv_types.selection_spec(args.kv_select)
    gguf_metadata.write_copy(args.model, args.output, recorded)


def refuse_what_latent_layers_lack(args: argparse.Namespace, clip: str, rotate: str, dither: str,
                                   n_layer: int) -> None:
    """ValueError for what acts on V rows, which a multi-head latent attention layer does not have (its V is K's
    first channels, read from K's tiles): the cache would refuse it at the first measurement."""
    what = None
    if rotate != "off":
        what = f"--kv-rotate {args.kv_rotate}"
    elif dither != "none":
        what = f"--kv-dither {args.kv_dither}"
    elif clip != "none" and any(r != 1.0 for r in native.resolve_clip(clip, n_layer)[1]):
        what = f"the V clip ratios of --kv-clip {args.kv_clip}"
    elif args.kv_select is not None:
        what = "--kv-select"
    if what is not None:
        raise ValueError(f"{args.model}: {what} would act on V rows, which a multi-head latent attention layer does "
                         "not have (its V is its K's first channels, read from K's tiles); leave it out")


def format_prose_limit(limit: float | None) -> str:
    if limit is None:
        return ""
    return f"; a mix's prose divergence kept within kivi2 everywhere's {limit:.4f}"


def format_clip_choice(choice: ClipChoice) -> str:
    turns = "; ".join(f"{part.upper()} " + ", ".join(f"{label}: {kld:.4f}" for label, kld in klds.items())
                      for part, klds in choice.turns)
    return ("kivi2 everywhere, KL divergence against f16 KV by clip ratio (V's with K unclipped, then each part's "
            f"with the other's choice in place): {turns}")


def format_held_out_clip(checked: HeldOutClip, n_tokens: int) -> str:
    parts = "; ".join(f"{part.upper()} " + ", ".join(f"{label}: {kld:.4f}" for label, kld in klds.items())
                      for part, klds in checked.klds)
    return (f"each part's clip choice against its runner-up on {n_tokens} held-out tokens of the text (after the "
            f"probe's), KL divergence against f16 KV: {parts}")


def format_dither_choice(choice: DitherChoice[MixCost]) -> str:
    return "the mix's cost by V dither: " + ", ".join(f"{spec}: {cost}" for spec, cost in choice.costs.items())


def format_window_choice(choice: WindowChoice, n_tokens: int) -> str:
    first = max(choice.klds) + clip_ratios.GROUP
    return (f"kivi2 everywhere, KL divergence against f16 KV over tokens {first}-{n_tokens - 1} by window (bits per "
            f"element at {choice.target_ctx} tokens): "
            + ", ".join(f"{w}: {kld:.4f} ({choice.bits[w]:.2f})" for w, kld in choice.klds.items())
            + f"; a bit per element buys {choice.kld_per_bit:.4f}")


def rotation_choice(text: str) -> str:
    """auto, or a --kv-rotate value as the spec the C API takes."""
    return text if text == "auto" else arguments.rotation(text)


def count_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count of 0 or more nor auto")
    return int(text)


def add_calibrate_command(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "calibrate", help="choose per-layer K/V widths for a bit budget and write them into a copy of the model",
        description="Chooses the kivi sinks count (the fewest within 2% of the best KL divergence against f16 "
                    "KV), which layers' K and V to rotate, SKVQ's clip ratios for K and V and the fp16 window "
                    "(priced at what its memory would buy as code bits), finds how much each layer's K and V at 4 "
                    "and at 1 bits, kivi2 elsewhere, changes the output's KL divergence (from the f16 run's "
                    "attention, or measured), picks the widths with the least total for the budget, refines them by "
                    "measuring mixes (where the budget affords kivi2 everywhere, none whose divergence on the text "
                    "alone exceeds its; the refined mix then kept only where it measures within kivi2 everywhere "
                    "on up to four stretches of the text that follow the probe's), chooses V's dithered rounding for "
                    "the result, and writes them as "
                    "kvq.kv_layers, kvq.kv_clip, kvq.kv_rotate, kvq.kv_dither, kvq.window and kvq.sinks into a copy of "
                    "the model, "
                    "which run then uses. Every KL divergence is taken over the text's first tokens and a recall span "
                    "(--recall) that repeats its start, so that reading distant tokens exactly counts as much as the "
                    "prose.")
    p.add_argument("-m", "--model", type=Path, required=True, help="GGUF model")
    p.add_argument("-f", "--file", type=Path, required=True, help="calibration text")
    p.add_argument("-o", "--output", type=Path, required=True, help="the GGUF copy to write")
    p.add_argument("--kv-budget", type=budget_argument, default=2.0,
                   help="mean code bits per K/V element (kivi4 = 4, kivi2 = 2, kivi1 = 1; default %(default)s)")
    p.add_argument("-c", "--ctx-size", type=int, default=512,
                   help="calibration tokens (default %(default)s); the held-out check reads up to four times as many "
                        "of the text after them")
    p.add_argument("--recall", type=int, metavar="N",
                   help="the last N of the -c tokens repeat the text from past its first "
                        f"{RECALL_START} tokens (where sinks would be), so that each choice is also judged on "
                        "recalling distant tokens exactly (what a pass key needs); the KL divergence weighs them and "
                        "the text alike; 0: the text alone (default: a quarter of -c)")
    p.add_argument("--kv-window", type=count_or_auto,
                   help="kivi window (recent tokens kept in fp16): a count, or auto to choose it among "
                        f"{', '.join(map(str, window_choice.CANDIDATES))}, each priced at what its fp16 cells would "
                        "buy as code bits at --kv-window-ctx (default: the cache's, 128; auto trades pass-key "
                        "retrieval for memory, see the README); written as the model's kvq.window")
    p.add_argument("--kv-window-ctx", type=int, metavar="N",
                   help="the context length the model will run at, where --kv-window auto weighs a window's memory "
                        "(default: the model's training context)")
    p.add_argument("--kv-sinks", type=count_or_auto, default="auto",
                   help="kivi sinks: a count, or auto to choose it on the text among "
                        f"{', '.join(map(str, SINK_CANDIDATES))} (default %(default)s); written as the model's "
                        "kvq.sinks")
    p.add_argument("--kv-clip", type=arguments.spec, default="auto", metavar="auto|none|SPEC",
                   help="SKVQ's clipping: auto measures, by the cache's KL divergence against f16 KV, no clipping, "
                        "the per-layer K and V ratios among "
                        f"{', '.join(map(str, clip_ratios.RATIOS))} with the least attention-output error on the "
                        "text, and one ratio per part searched by that KL divergence, and keeps the lowest, V and K "
                        "taking turns, each with the other's choice in place, until a turn changes nothing; or give a "
                        "--kv-clip spec or none (default %(default)s); written as the model's kvq.kv_clip and used "
                        "while measuring")
    p.add_argument("--kv-rotate", default="auto", metavar="auto|on|off|SPEC", type=rotation_choice,
                   help="upstream's Hadamard rotation of the kivi layers: auto measures, by the cache's KL divergence "
                        "against f16 KV, none, every layer, and each layer's K and V rotated where that lowers its "
                        "attention-output error on the text, and keeps the lowest; or give on, off or a --kv-rotate "
                        "spec (default %(default)s); written as the model's kvq.kv_rotate and used while measuring")
    p.add_argument("--kv-dither", type=arguments.spec, default="auto", metavar="auto|none|SPREAD|SPEC",
                   help="V's dithered rounding: auto measures the finished mix, by the cache's KL divergence against "
                        "f16 KV, with its 1- and 2-bit V layers rounded to nearest and at spreads "
                        f"{', '.join(f'{s:g}' for s in dither_choice.SPREADS[1:])}, and keeps the lowest; or give "
                        "none or a --kv-dither spec (default %(default)s); written as the model's kvq.kv_dither and "
                        "used while measuring")
    p.add_argument("--kv-select", metavar="HH,RW[,N[,D]]", type=arguments.selection,
                   help="MiniKV's prompt selection for the copy (as `pykvq run --kv-select` takes it), written as "
                        "its kvq.select; not measured here: the calibration judges whole prompts, whose logits "
                        "selection leaves as they are")
    p.add_argument("--sensitivity", choices=SENSITIVITY_SOURCES, default="attention",
                   help="attention: each layer's sensitivities from the f16 run's attention output error at each "
                        "width, scaled into KL divergence by two measured mixes; measured: each tensor at 4 and "
                        "1 bits measured with the real cache, 4 x n_layer runs (default %(default)s)")
    p.add_argument("--refine", type=int, default=24,
                   help="mixes measured as a whole after the additive choice, each one step from the best so far; "
                        "0 keeps the additive choice (default %(default)s)")
    p.add_argument("--retrieval", type=int, default=0, metavar="N",
                   help="pass-key prompts built over the text (a number stated right before a question about it) "
                        "that the refined mixes are also judged on: the KL divergence at the answer's first token "
                        "added to the probe's (a mix can lose a pass key at the same probe divergence); a study "
                        "option, 4x the calibration time with 4 prompts, and on SmolLM2 it did not keep the key (see "
                        "the README); 0: none (default %(default)s)")
    p.add_argument("--retrieval-ctx", type=int, metavar="N",
                   help="with --retrieval, each pass-key prompt's length in tokens: the loss shows only past a long "
                        f"context (default {RETRIEVAL_CTX})")
    p.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1, help="threads (default: all cores)")
    arguments.add_device_arguments(p)
    arguments.add_fit_arguments(p, context=False)
    p.set_defaults(handler=run)
