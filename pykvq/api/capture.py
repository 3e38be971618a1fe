"""Tensors of llama.cpp's graph as it computes them (its eval callback, cb_eval): the post-RoPE Q, K and V that every
attention layer attends with, for calibration on the model as llama.cpp runs it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from pykvq.bindings import native


class TensorObserver(Protocol):
    """What a context takes as its eval callback (ContextConfig.observer)."""

    def c_callback(self) -> object:
        """llama_context_params.cb_eval: a C function pointer that stays valid while the observer lives."""


@dataclass
class AttentionCapture:
    """Each layer's Q, K and V of one ubatch of n_tokens tokens, as [n_tokens, heads, head_dim] float32 arrays.

    The families name the steps of their Q, K and V each their own way (LFM2 names none after its projection, Gemma 4
    its rotated ones "Qcur_pos"); pykvq's libllama names what the attention reads "attn_q-<layer>", "attn_k-<layer>"
    and "attn_v-<layer>" (patch 0027). A layer that attends no K and V of its own (a hybrid's recurrent layer, a
    layer reading an earlier layer's cache) has no attn_k or attn_v. A multi-head latent attention layer's V is a view
    of its K's first channels, and its attention output before the per-head V projection "kqv_latent-<layer>"
    (patch 0028)."""

    n_tokens: int
    tensors: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    _callback: object = field(default=None, repr=False)
    _error: Exception | None = field(default=None, repr=False)

    # and what it computes from them: upstream names each layer's attention output kqv_out-<layer>
    NAME = re.compile(rb"^(?:attn_([qkv])|kqv_(out|latent))-(\d+)$")

    def c_callback(self) -> object:
        lib = native.libs()

        @lib.ffi.callback("bool(void *, bool, void *)")
        def observe(tensor, ask: bool, _user_data) -> bool:
            name = self.NAME.match(lib.ffi.string(lib.ggml_base.ggml_get_name(tensor)))
            if ask or name is None:
                return name is not None
            # an exception must not cross into C: kept, and raised by layer()
            try:
                self._keep(lib, tensor, name.group(0).decode(), (name.group(1) or name.group(2)).decode(),
                           int(name.group(3)))
            except (ValueError, MemoryError) as exc:
                self._error = exc
            return True

        self._callback = observe
        return lib.ffi.cast("void *", observe)

    def _keep(self, lib, tensor, name: str, what: str, layer: int) -> None:
        n = lib.ggml_base.ggml_nelements(tensor)
        if lib.ggml_base.ggml_nbytes(tensor) != 4 * n or n % self.n_tokens != 0:
            raise ValueError(f"{name} is not float32 over the {self.n_tokens} tokens of one ubatch")
        data = np.empty(n, dtype=np.float32)
        lib.ggml_base.ggml_backend_tensor_get(tensor, lib.ffi.from_buffer(data), 0, data.nbytes)
        rows = lib.ggml_base.ggml_nrows(tensor)
        heads = rows // self.n_tokens
        self.tensors[what, layer] = data.reshape(self.n_tokens, heads, n // rows)

    def kv_layers(self) -> list[int]:
        """The layers that attended with Q, K and V of their own."""
        if self._error is not None:
            raise self._error
        return sorted(il for what, il in self.tensors if what == "k" and ("q", il) in self.tensors
                      and ("v", il) in self.tensors)

    def output(self, layer: int) -> np.ndarray:
        """The layer's attention output [tokens, heads, V's head size] (before its output projection; a latent
        layer's before its V projection, over the V it attends)."""
        q = self.layer(layer)[0]
        what = "latent" if ("latent", layer) in self.tensors else "out"
        if (what, layer) not in self.tensors:
            raise ValueError(f"llama.cpp's graph named no kqv_out tensor in layer {layer}")
        return self.tensors[what, layer].reshape(self.n_tokens, q.shape[1], -1)

    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Q [tokens, heads, dim], K and V [tokens, KV heads, dim] of a layer; V split into K's heads where the graph
        names it unsplit."""
        if self._error is not None:
            raise self._error
        try:
            q, k, v = (self.tensors[what, layer] for what in "qkv")
        except KeyError as exc:
            raise ValueError(f"llama.cpp's graph named no attn_{exc.args[0][0]} tensor in layer {layer}: its Q, K "
                             "and V cannot be captured for calibration") from None
        return q, k, v.reshape(self.n_tokens, k.shape[1], -1)
