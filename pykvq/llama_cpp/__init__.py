"""llama-cpp-python on pykvq's libllama: existing ``llama_cpp.Llama`` code gets the kivi KV types.

Install llama-cpp-python's Python package without its own llama.cpp build, then load it through here:

    CMAKE_ARGS="-DLLAMA_BUILD=OFF" pip install "llama-cpp-python[server]==0.3.36"

    import pykvq
    from pykvq.llama_cpp import Llama
    llm = Llama(model_path="model.gguf", flash_attn=True,
                type_k=pykvq.GGML_TYPE_KIVI2, type_v=pykvq.GGML_TYPE_KIVI2, kv_window=64)

The OpenAI-compatible server on the same terms: ``python -m pykvq.llama_cpp.server`` (server.py).

``Llama`` here is a subclass of llama_cpp.Llama that checks the KV types and applies pykvq's kivi settings
(window, sinks, rotation) while its context is created.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import functools
from collections.abc import Callable, Collection, Mapping
from functools import cache
from pathlib import Path
from types import ModuleType

from pykvq import gguf_metadata, kv_types, paths
from pykvq.api.llama import KvConfig, add_rpc_servers, kvq_params_applied
from pykvq.bindings import native
from pykvq.bindings.log import sink

log = logging.getLogger(__name__)

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the release whose llama.cpp pykvq patches (pykvq/upstream.py)
LIB_PATH_ENV = "LLAMA_CPP_LIB_PATH"
MTMD_PATH_ENV = "MTMD_CPP_LIB"  # the folder of libmtmd, which the multimodal chat handlers load
INSTALL_HINT = f'CMAKE_ARGS="-DLLAMA_BUILD=OFF" pip install "llama-cpp-python[server]=={LLAMA_CPP_PYTHON_VERSION}"'
# pykvq's keyword arguments of Llama, each a KvConfig field with the prefix
KV_OPTIONS = ("kv_window", "kv_sinks", "kv_rotate", "kv_layers", "kv_rollback", "kv_type_swa", "kv_select", "kv_clip",
              "kv_dither")


class LlamaCppError(RuntimeError):
    """llama-cpp-python is missing, of another version, or bound to another libllama."""


def library_dir() -> Path:
    """The folder holding pykvq's libllama: what LLAMA_CPP_LIB_PATH must name."""
    return paths.lib_dir()


def _loaded_library(module: ModuleType) -> Path:
    return Path(module.llama_cpp._lib._name).resolve()


def load() -> ModuleType:
    """Import llama_cpp bound to pykvq's libllama, or say why it cannot be."""
    ours = paths.library("llama").resolve()
    for variable, library in ((LIB_PATH_ENV, "libllama"), (MTMD_PATH_ENV, "libmtmd")):
        requested = os.environ.get(variable)
        if requested is not None and Path(requested).resolve() != library_dir().resolve():
            raise LlamaCppError(f"{variable}={requested} names another {library} than pykvq's ({library_dir()}); "
                                f"unset it, or set it to pykvq's folder")
    already = sys.modules.get("llama_cpp")
    if already is not None and _loaded_library(already) != ours:
        raise LlamaCppError(f"llama_cpp was imported before pykvq.llama_cpp and runs on {_loaded_library(already)}, "
                            f"not pykvq's {ours}: import pykvq.llama_cpp first (or set {LIB_PATH_ENV}="
                            f"{library_dir()})")
    os.environ[LIB_PATH_ENV] = str(library_dir())
    os.environ[MTMD_PATH_ENV] = str(library_dir())
    try:
        import llama_cpp
    except ModuleNotFoundError as exc:
        raise LlamaCppError(f"llama-cpp-python is not installed; install it without its own llama.cpp build: "
                            f"{INSTALL_HINT}") from exc
    if llama_cpp.__version__ != LLAMA_CPP_PYTHON_VERSION:
        raise LlamaCppError(f"llama-cpp-python {llama_cpp.__version__} is installed; pykvq's libllama is the "
                            f"llama.cpp of {LLAMA_CPP_PYTHON_VERSION}, whose C API it mirrors: {INSTALL_HINT}")
    if _loaded_library(llama_cpp) != ours:
        raise LlamaCppError(f"llama_cpp loaded {_loaded_library(llama_cpp)} instead of pykvq's {ours}")
    _share_log()
    return llama_cpp


def check_kv_type(type_id: int | str | None) -> None:
    """Refuse a type int the KV cache cannot hold, before llama.cpp sees it."""
    if type_id is None:
        return
    valid = {t.id: t.name for t in native.kv_cache_types()}
    ids = {name: i for i, name in valid.items()}
    if isinstance(type_id, str) and type_id in ids:
        # llama_cpp.Llama takes ggml type ids, not names
        constant = f"pykvq.GGML_TYPE_{type_id.upper()} " if type_id.startswith("kivi") else ""
        raise ValueError(f"type_k/type_v take a ggml type id, not a name: for {type_id!r} pass "
                         f"{constant}({ids[type_id]})")
    if type_id not in valid:
        listed = ", ".join(f"{i} ({name})" for i, name in valid.items())
        raise ValueError(f"unknown KV cache type {type_id!r}; valid: {listed}")


def check_kv_options(kwargs: Mapping[str, object], upstream: Collection[str]) -> None:
    """TypeError for a kv_* keyword argument that is neither pykvq's nor upstream's (kv_overrides): upstream's
    Llama takes any keyword and drops it, so `kv_type="kivi2"` ran an f16 cache without a word."""
    unknown = sorted(name for name in kwargs if name.startswith("kv_") and name not in KV_OPTIONS + tuple(upstream))
    if unknown:
        raise TypeError(f"Llama() got unexpected keyword arguments {', '.join(unknown)}: the KV types are type_k and "
                        f"type_v (e.g. pykvq.GGML_TYPE_KIVI2), the kivi settings {', '.join(KV_OPTIONS)}")


def kv_config(kwargs: Mapping[str, object]) -> KvConfig:
    """A Llama's KV settings from its keyword arguments (type_k, type_v and KV_OPTIONS; kv_rollback None: the
    draft_model's length), checked as creating its context would check them (ValueError): before llama-cpp-python
    allocates anything."""
    check_kv_type(kwargs.get("type_k"))
    check_kv_type(kwargs.get("type_v"))

    def name(type_id: object) -> str:
        return "f16" if type_id is None else kv_types.type_name(type_id)

    options = {option.removeprefix("kv_"): kwargs.get(option) for option in KV_OPTIONS}
    if options["rollback"] is None:
        options["rollback"] = draft_length(kwargs.get("draft_model"))
    kv = KvConfig(name(kwargs.get("type_k")), name(kwargs.get("type_v")), **options)
    if kv.layers in (None, "none") and (kv.type_k in kv_types.KIVI_BITS) != (kv.type_v in kv_types.KIVI_BITS):
        raise ValueError(f"a kivi K type needs a kivi V type and the other way round: type_k {kwargs.get('type_k')} "
                         f"({kv.type_k}) and type_v {kwargs.get('type_v')} ({kv.type_v}); pass the same kivi type "
                         "for both (or per-layer types with kv_layers)")
    with kvq_params_applied(kv):
        pass  # the window, sinks, rotation, per-layer and sliding-window types are refused here, with the reason
    return kv


def model_layer_spec(args: tuple, kwargs: Mapping[str, object]) -> str | None:
    """The model's kvq.kv_layers (pykvq calibrate and convert write it), which its cache takes where kv_layers is not
    given, whatever type_k/type_v say; None where it has none, or where the file cannot be read here (llama.cpp then
    says why)."""
    path = kwargs.get("model_path", args[0] if args else None)
    if not isinstance(path, (str, os.PathLike)):
        return None
    try:
        spec = gguf_metadata.read_kvq(Path(path)).get(gguf_metadata.KEY_LAYERS)
    except gguf_metadata.GgufError:
        return None
    return str(spec) if spec not in (None, "", "none") else None


def flash_attn_reason(kv: KvConfig, model_layers: str | None) -> str | None:
    """Why this Llama's cache needs flash attention (llama-cpp-python's default is off), None where it does not:
    kivi types given, or a model's own per-layer types where none are given."""
    if kv.needs_flash_attn:
        return kv.flash_attn_reason
    if kv.layers is None and model_layers is not None:
        return f"the model's kvq.kv_layers ({model_layers}) are read by the fused attention only"
    return None


def draft_length(draft_model: object) -> int | None:
    """How many tokens a llama-cpp-python draft model proposes at a time (LlamaPromptLookupDecoding's
    num_pred_tokens): the rejected ones are removed again, so a kivi cache's rollback must cover them."""
    length = getattr(draft_model, "num_pred_tokens", None)
    return length if isinstance(length, int) and length > 0 else None


def _explained(exc: Exception) -> str:
    """``exc``'s message with llama.cpp's first error line since the last ``sink().take_problems()``, where it logged
    one: llama-cpp-python's own messages ("Failed to create llama_context") leave out the cause."""
    problems = sink().take_problems()
    return f"{exc}: {problems[0]}" if problems else str(exc)


def _share_log() -> None:
    """llama-cpp-python replaced llama.cpp's log callback when imported (one per process): pykvq's takes it back,
    so pykvq's exceptions keep llama.cpp's reasons, and hands every line on to llama-cpp-python's once a Llama has
    set that one's level (verbose); before, its level lets everything through, which llama-cpp-python alone never
    shows (its first call into llama.cpp is a Llama's), and which pykvq's own Model printed: thousands of lines."""
    from llama_cpp import _logger

    def forward(level: int, text: bytes) -> None:
        if _logger.logger.level != logging.NOTSET:
            _logger.llama_log_callback(level, text, None)

    kept = sink()
    kept.forward = forward
    kept.install()


@cache
def _llama_class() -> type:
    llama_cpp = load()
    # upstream's own, read before a server replaces llama_cpp.Llama with a subclass of this one
    upstream_parameters = frozenset(inspect.signature(llama_cpp.Llama.__init__).parameters)

    class Llama(llama_cpp.Llama):
        """llama_cpp.Llama on pykvq's libllama; kv_window, kv_sinks and kv_rotate set the kivi layers (defaults: the
        model's kvq.window, kvq.sinks and kvq.kv_rotate, else 128, 0 and off; kv_rotate also takes a per-layer spec such
        as "k:*=on;v:0-3=off,4-=on"), kv_layers per-layer types (e.g. "asymkv:16/0"), kv_rollback how many last tokens
        can be removed exactly (speculative decoding's rejected drafts; default: the draft_model's num_pred_tokens, else
        0), kv_type_swa the type name of the sliding-window cache of a Gemma-2/3 or gpt-oss model (default: type_k /
        type_v), kv_select MiniKV's prompt selection as (heavy-hitter share, recent share[, observation window[, pyramid
        depth]]), e.g. (0.25, 0.25): n_batch and n_ubatch then default to n_ctx, as a prompt must reach the cache in one
        ubatch; kv_clip SKVQ's per-layer clip ratios (e.g. "k:*=0.9;v:*=0.85"; default: the model's kvq.kv_clip);
        kv_dither V's dithered rounding, a spread in [0, 1] or per layer (e.g. 0.5, "v:0-9=1,10-=0"; default: the
        model's kvq.kv_dither, else nearest). Flash attention is switched on for kivi types, and for a model's own
        kvq.kv_layers where kv_layers is not given: the fused attention alone reads them."""

        def __new__(cls, *args, **kwargs) -> Llama:
            # every setting is refused before an instance exists: upstream's __del__ fails on a half-built Llama
            check_kv_options(kwargs, upstream_parameters)
            kv = kv_config(kwargs)
            reason = flash_attn_reason(kv, model_layer_spec(args, kwargs))
            if reason and kwargs.get("flash_attn") is False:
                raise ValueError(f"{reason}: pass flash_attn=True")
            if kv.is_kivi and kwargs.get("embedding"):
                raise ValueError("embedding=True packs up to min(n_batch, 256) texts into one unified KV cache whose "
                                 "cells any text may take; a kivi cache gives each sequence a fixed region of 32-token "
                                 "tiles: embed with an f16 or q8_0 KV cache")
            llm = super().__new__(cls)
            # for __init__, which would read the model's header again
            llm._needs_flash_attn = reason is not None
            return llm

        def __init__(self, *args, **kwargs) -> None:
            kv = kv_config(kwargs)
            kwargs = {name: value for name, value in kwargs.items() if name not in KV_OPTIONS}
            # llama-cpp-python's rpc_servers (its server's --rpc_servers): upstream now registers them as devices
            rpc_servers = kwargs.pop("rpc_servers", None)
            if rpc_servers:
                add_rpc_servers(rpc_servers)
            if self._needs_flash_attn:
                kwargs["flash_attn"] = True
            if kwargs.get("draft_model") is not None:
                # a draft model turns upstream's logits_all on, but its scores keep n_batch rows unless the argument
                # says so: a prompt and reply past n_batch tokens failed to broadcast into them
                kwargs["logits_all"] = True
            if kv_types.selects(kv.select):
                # llama-cpp-python decodes a prompt in n_batch pieces: selection needs it whole
                n_ctx = kwargs.get("n_ctx", 512) or 512
                kwargs.setdefault("n_batch", n_ctx)
                kwargs.setdefault("n_ubatch", n_ctx)
            sink().take_problems()
            with kvq_params_applied(kv):
                try:
                    super().__init__(*args, **kwargs)
                except ValueError as exc:
                    # e.g. the model's kvq.* metadata it could not use
                    raise ValueError(_explained(exc)) from exc
            if kv.type_swa is not None and llama_cpp.llama_model_n_swa(self.model) == 0:
                log.warning("kv_type_swa %s changes nothing: %s has no sliding-window layers", kv.type_swa,
                            Path(self.model_path).name)
            if llama_cpp.llama_model_has_encoder(self.model):
                # llama-cpp-python decodes without llama_encode, which aborts the process at the first eval
                self.close()
                raise ValueError(f"{self.model_path} is an encoder-decoder model (T5): llama-cpp-python decodes it "
                                 "without encoding, which llama.cpp aborts on; llama.cpp's llama-completion runs it")

        def _follow_the_cache(self) -> None:
            # llama-cpp-python's token count, which its prefix reuse trusts, after the cache refused to change
            memory = llama_cpp.llama_get_memory(self._ctx.ctx)
            self.n_tokens = max(0, llama_cpp.llama_memory_seq_pos_max(memory, 0) + 1)

        def load_state(self, state) -> None:
            sink().take_problems()
            try:
                super().load_state(state)
            except RuntimeError as exc:
                # a refused load leaves the cache cleared (or the sequence)
                self._follow_the_cache()
                raise RuntimeError(_explained(exc)) from exc

        def eval(self, tokens) -> None:
            # upstream's eval ignores a refused removal (a rejected draft deeper than the kivi ring's slack) and
            # then fails to decode with "llama_decode returned -1"
            sink().take_problems()
            if not self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1):
                problems = sink().take_problems()
                held = self.n_tokens
                self._follow_the_cache()
                reason = problems[0] if problems else "the KV cache refused the removal"
                raise RuntimeError(f"cannot go back to token {held} of {self.n_tokens}: {reason}; Llama(kv_rollback=N) "
                                   "keeps the last N tokens removable (a draft model's rejected tokens)")
            super().eval(tokens)

        def close(self) -> None:
            super().close()
            self._freed = True

    for name in FREED_GUARDS:
        setattr(Llama, name, _refused_once_freed(getattr(Llama, name)))
    return Llama


# what reaches llama.cpp through a Llama's model or context: upstream's close() frees them and keeps the pointers,
# so any of these after it crashed the process (create_completion and chat through tokenize, generate through eval)
FREED_GUARDS = ("tokenize", "detokenize", "eval", "sample", "embed", "save_state", "load_state", "reset", "n_ctx",
                "n_embd", "n_vocab", "token_eos", "token_bos", "token_nl", "pooling_type")


def _refused_once_freed(method: Callable) -> Callable:
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        if getattr(self, "_freed", False):
            raise RuntimeError("this Llama is closed: close() freed its model and context; create another Llama")
        return method(self, *args, **kwargs)

    return guarded


def __getattr__(name: str):
    # the subclass needs llama_cpp, which must not be imported before load() has pointed it at our library
    if name == "Llama":
        return _llama_class()
    raise AttributeError(f"module 'pykvq.llama_cpp' has no attribute {name!r}")
