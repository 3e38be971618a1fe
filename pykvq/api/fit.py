"""Placing a model and sizing its context to the devices' free memory, as llama.cpp's tools do with -fit on.

    from pykvq import ContextConfig, KvConfig, Model, fit_placement
    config = ContextConfig(n_ctx=0, kv=KvConfig.preset("kivi2"))   # 0: as long as memory allows
    placement = fit_placement("model.gguf", config)
    with Model("model.gguf", n_gpu_layers=placement) as model:
        ctx = model.context(placement.context_config(config))

Upstream's fit (common_fit_params) loads the model and a context without allocating them and measures what each
device would hold, kivi caches as they really are, then reduces an unset context (n_ctx 0) down to a minimum and
moves layers off the GPUs until each device keeps its margin free.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pykvq.api.llama import ContextConfig, LlamaError, _call, _fail, context_params, kvq_params_applied
from pykvq.bindings import native
from pykvq.bindings.log import sink

log = logging.getLogger("pykvq")

MIB = 1024 * 1024
DEFAULT_MARGIN_MIB = 1024  # upstream's --fit-target
DEFAULT_N_CTX_MIN = 4096  # upstream's --fit-ctx
ALL_LAYERS = -1  # llama_model_default_params' n_gpu_layers: every layer where a device takes them

_FITTED, _NO_FIT, _ERROR = 0, 1, 2  # enum llama_kvq_fit_status


@dataclass(frozen=True)
class Placement:
    """Where a model's layers go (n_gpu_layers; -1 every layer) and how many tokens its context holds: pass it as
    Model's n_gpu_layers. fitted: False where no placement was projected to fit; then it is what was asked."""

    n_gpu_layers: int
    n_ctx: int
    fitted: bool
    # the tensor split and tensor overrides the fit wrote, which the model's parameters point into while it loads
    _buffers: tuple[object, object] = field(repr=False, compare=False)

    def apply(self, mparams) -> None:
        """Set llama_model_params as the fit left them."""
        tensor_split, overrides = self._buffers
        mparams.n_gpu_layers = self.n_gpu_layers
        if any(tensor_split):
            mparams.tensor_split = tensor_split
        if overrides[0].pattern != native.libs().ffi.NULL:
            mparams.tensor_buft_overrides = overrides

    def context_config(self, config: ContextConfig) -> ContextConfig:
        """``config`` with the fitted context size."""
        return replace(config, n_ctx=self.n_ctx)


def fit_placement(path: str | os.PathLike, config: ContextConfig, n_gpu_layers: int = ALL_LAYERS,
                  margin_mib: int | Sequence[int] = DEFAULT_MARGIN_MIB,
                  n_ctx_min: int = DEFAULT_N_CTX_MIN) -> Placement:
    """Fit the model at ``path`` and a context of ``config`` to the devices' free memory, each keeping
    ``margin_mib`` free (one value, or one per device: --fit-target); n_gpu_layers other than -1 is kept as
    given (-ngl), config.n_ctx 0 is reduced as far as n_ctx_min per sequence (--fit-ctx). The fit's trace reaches
    the log at debug level (pykvq -v)."""
    lib = native.libs()
    ffi = lib.ffi
    n_devices = lib.llama.llama_max_devices()
    margins = [margin_mib] * n_devices if isinstance(margin_mib, int) else list(margin_mib)
    if not margins or len(margins) > n_devices or min(margins) < 0:
        raise LlamaError(f"--fit-target takes one margin in MiB of 0 or more, or one per device (at most "
                         f"{n_devices}), got {margin_mib!r}")
    margins += [margins[-1]] * (n_devices - len(margins))
    if n_ctx_min <= 0:
        raise LlamaError(f"--fit-ctx must be a positive number of tokens, got {n_ctx_min}")
    sink()
    mparams = ffi.new("struct llama_model_params *", lib.llama.llama_model_default_params())
    mparams.n_gpu_layers = n_gpu_layers
    cparams = ffi.new("struct llama_context_params *", context_params(lib, config))
    tensor_split = ffi.new("float[]", n_devices)
    overrides = ffi.new("struct llama_model_tensor_buft_override[]", lib.llama.llama_max_tensor_buft_overrides())
    c_margins = ffi.new("size_t[]", [m * MIB for m in margins])
    with kvq_params_applied(config.kv):
        status = _call(lib.common.llama_kvq_fit_params, str(path).encode(), mparams, cparams, tensor_split,
                       overrides, c_margins, n_ctx_min, log.isEnabledFor(logging.DEBUG))
    if status == _ERROR:
        raise _fail(f"cannot fit {path} and its context to the free memory")
    return Placement(mparams.n_gpu_layers, cparams.n_ctx, status == _FITTED, (tensor_split, overrides))
