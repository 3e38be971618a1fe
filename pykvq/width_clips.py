"""A calibrated copy's clip ratios at each width, for caches whose per-layer types are not the copy's.

pykvq calibrate chooses SKVQ's clip ratio per tensor and width (a 1-bit V clips near 0.7, a 2-bit one near 0.9, a
4-bit tensor hardly at all) and writes kvq.kv_clip, each tensor at its width in kvq.kv_layers, beside each width's
ratios in every tensor (kvq.calibration.kivi4_clip, kivi2_clip, kivi1_clip). A cache whose types come from elsewhere
(`--kv-type kivi4` on the copy, another --kv-layers) takes each tensor's ratio at the width it runs at from those;
kvq.kv_clip would clip it at the ratio of a width it does not run at. The patched llama.cpp applies the same rule
where the caller gives no clip (llama_kv_cache::kvq_init, kvq_clips_by_width); pykvq's commands resolve it here to
say which ratios a cache runs with.
"""

from __future__ import annotations

from pykvq import gguf_metadata, kv_types
from pykvq.bindings import native
from pykvq.calibration.clip_ratios import clip_spec_per_layer


def clip_by_width(kvq: dict[str, object], types_k: list[str], types_v: list[str]) -> str | None:
    """The --kv-clip spec that gives each layer's K and V its width's ratio from the model's per-width ratios; None
    where a kivi width among the types has none (or no layer is kivi)."""
    n_layer = len(types_k)
    ratios = {"k": [1.0] * n_layer, "v": [1.0] * n_layer}
    widths = {t for t in types_k + types_v if t in kv_types.KIVI_BITS}
    for width in sorted(widths):
        spec = kvq.get(gguf_metadata.WIDTH_CLIP_KEYS[width])
        if not isinstance(spec, str) or not spec:
            return None
        by_part = dict(zip(("k", "v"), native.resolve_clip(spec, n_layer), strict=True))
        for part, types in (("k", types_k), ("v", types_v)):
            for il, t in enumerate(types):
                if t == width:
                    ratios[part][il] = by_part[part][il]
    return clip_spec_per_layer(ratios) if widths else None
