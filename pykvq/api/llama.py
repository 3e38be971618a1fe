"""A small typed Python API over the built libllama: models, contexts with pykvq's KV settings, generation.

    from pykvq import Model, KvConfig
    with Model("model.gguf") as model:
        for piece in model.generate("Once upon a time", n_predict=64, kv=KvConfig.preset("kivi2")):
            print(piece, end="", flush=True)

Errors reported by llama.cpp become :class:`LlamaError` carrying llama.cpp's own message.
"""

from __future__ import annotations

import codecs
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

import numpy as np

from pykvq import gguf_metadata, kv_types
from pykvq.api.sampling import Sampler, SamplerSettings
from pykvq.bindings import devices, native
from pykvq.bindings.log import sink
from pykvq.input_files import check_readable_file
from pykvq.kv_types import KIVI_BITS, UNQUANTIZED_TYPES, Selection, selection_depth

if TYPE_CHECKING:
    from pykvq.api.capture import TensorObserver

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
INT32_MAX = 2**31 - 1  # llama_context_params' counts are 32-bit
LLAMA_LOAD_MODE_NONE = 0  # enum llama_load_mode: read nothing but what is asked
T = TypeVar("T")


class LlamaError(RuntimeError):
    """llama.cpp refused or failed; the message is llama.cpp's own where it gave one."""


def _call(function: Callable[..., T], *args: object) -> T:
    """``function(*args)`` into llama.cpp, with the error lines logged before it forgotten: a failure is explained
    by its own (the log is the process's, shared with anything else on this libllama, llama-cpp-python too)."""
    sink().take_problems()
    return function(*args)


def _fail(what: str) -> LlamaError:
    problems = sink().take_problems()
    return LlamaError(f"{what}: {problems[0]}" if problems else what)


@dataclass(frozen=True)
class KvConfig:
    """The KV cache of a context: K and V types, and the kivi settings (None: pykvq's defaults). ``layers``:
    per-layer types (``"asymkv:16/0"``, ``"k:0-15=kivi2,16-=kivi1;v:*=kivi1"``); None lets a model's
    kvq.kv_layers metadata apply (whatever type_k and type_v say), ``"none"`` ignores it. ``rollback``: how many
    of a sequence's last tokens can be removed exactly (Context.truncate, speculative decoding), at the cost of
    that many more fp16 cells.
    ``type_swa``: K and V type of the sliding-window cache of a model with sliding-window layers (Gemma 2/3,
    gpt-oss); None: type_k / type_v, as for the global layers. ``window`` and ``sinks`` None: the model's
    kvq.window / kvq.sinks, else pykvq's defaults. ``select``: MiniKV's prompt selection, the heavy-hitter and
    recent shares of a prompt that its sequence keeps (e.g. ``(0.25, 0.25)``), and optionally how many of the
    prompt's last tokens pick the heavy hitters by their attention (``(0.25, 0.25, 32)``; 0: all of them; left out:
    the default) and the pyramid depth (``(0.25, 0.25, 0, 3.0)``: the bottom layer keeps 0.25*(2 - 1/3) of the
    prompt as heavy hitters, the top one 0.25/3; left out: 1, every layer alike); the prompt must be decoded in one
    call that fits one ubatch (n_ubatch), and every layer must be
    kivi; None: the model's kvq.select (a prompt it cannot take is kept whole), ``kv_types.SELECT_OFF``: none.
    ``clip``: SKVQ's clipped quantization, per-layer ratios in the ``layers`` form (``"k:*=0.9;v:*=0.85"``); None
    lets a model's kvq.kv_clip metadata apply, ``"none"`` ignores it. ``rotate``: upstream's Hadamard rotation of the
    kivi layers, True/False for all, or per layer in the ``layers`` form with on/off (``"k:*=on;v:0-3=off,4-=on"``);
    None lets a model's kvq.kv_rotate apply, else off. ``dither``: V's dithered rounding, a spread in [0, 1] for every
    layer (``0.5`` or ``"0.5"``; 1: stochastic rounding) or per layer with a v: part only (``"v:0-9=1,10-=0"``),
    which keeps repeated tokens' V errors from adding up; None lets a model's kvq.kv_dither apply, ``"none"`` rounds
    to nearest."""

    type_k: str = "f16"
    type_v: str = "f16"
    window: int | None = None
    sinks: int | None = None
    rotate: bool | str | None = None
    layers: str | None = None
    rollback: int | None = None
    type_swa: str | None = None
    select: Selection | None = None
    clip: str | None = None
    dither: str | float | None = None

    def __post_init__(self) -> None:
        if gguf_metadata.is_number(self.dither):
            # one spread for every layer, as the C API's spec writes it (a float reached its string handling)
            object.__setattr__(self, "dither", f"{self.dither:g}")
        for name in ("layers", "type_swa", "clip", "dither"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                example = {"clip": ' such as "k:*=0.9;v:*=0.85"'}.get(name, "")
                raise TypeError(f"KvConfig {name}={value!r}: give a spec string{example} or None")
        # the C API reads "" as "the model's setting", which None already says: "" is a caller's empty variable
        for name in ("rotate", "layers", "type_swa", "clip", "dither"):
            value = getattr(self, name)
            if isinstance(value, str) and not value.strip():
                raise ValueError(f"KvConfig {name}={value!r}: an empty spec; None lets the model's setting apply")

    @classmethod
    def preset(cls, name: str, **settings) -> KvConfig:
        """K and V of one type, e.g. ``KvConfig.preset("kivi2", window=64)``."""
        return cls(name, name, **settings)

    @property
    def rotation_spec(self) -> str:
        """``rotate`` as the C API's rotation spec: "" lets the model's kvq.kv_rotate apply."""
        if isinstance(self.rotate, bool):
            return "on" if self.rotate else "off"
        return self.rotate or ""

    @property
    def is_kivi(self) -> bool:
        """Whether the cache may hold kivi layers (then it needs flash attention)."""
        return (self.type_k in KIVI_BITS or self.type_v in KIVI_BITS or self.type_swa in KIVI_BITS
                or self.layers not in (None, "none"))

    @property
    def needs_flash_attn(self) -> bool:
        """Whether the cache may hold a quantized V: kivi layers, or a quantized sliding-window cache, which llama.cpp
        reads through flash attention only."""
        return self.is_kivi or (self.type_swa is not None and self.type_swa not in UNQUANTIZED_TYPES)

    @property
    def flash_attn_reason(self) -> str:
        """Why flash attention is needed, where it is."""
        if self.is_kivi:
            return "kivi KV types are read by the fused attention only"
        return f"the sliding-window cache's quantized V (type_swa {self.type_swa}) is read by flash attention only"

    def kvq_params(self) -> native.KvqParams:
        """The C API's settings; a window or sink count left None takes the model's kvq.window / kvq.sinks (pykvq
        calibrate writes them), else the default; ValueError for a negative one."""
        for what, value in (("recent window", self.window), ("sink count", self.sinks)):
            if value is not None and value < 0:
                raise ValueError(f"the {what} must be 0 or more tokens, got {value}")
        defaults = native.kvq_default_params()
        if self.select is None:
            select_hh, select_recent, observe, depth = (native.KVQ_FROM_MODEL,) * 4
        else:
            select_hh, select_recent, *rest = self.select
            observe = int(rest[0]) if rest else defaults.select_observe
            depth = selection_depth(self.select)
        return native.KvqParams(
            native.KVQ_FROM_MODEL if self.window is None else self.window,
            native.KVQ_FROM_MODEL if self.sinks is None else self.sinks,
            self.rotate if isinstance(self.rotate, bool) else defaults.rotate,
            defaults.n_rollback if self.rollback is None else self.rollback,
            select_hh, select_recent, observe, depth)


@dataclass(frozen=True)
class ContextConfig:
    """llama_context_params that pykvq exposes, named after llama.cpp's flags (-c, -b, -ub, -t, -fa)."""

    n_ctx: int = 4096
    n_batch: int = 2048
    n_ubatch: int = 512
    n_threads: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    flash_attn: str = "auto"
    kv: KvConfig = KvConfig()
    # sequences the context holds (-np); kv_unified: one cell range for all (--kv-unified), in which a kivi
    # cache gives each sequence n_ctx / n_seq_max cells, as per-sequence streams do (the default)
    n_seq_max: int = 1
    kv_unified: bool = False
    # upstream's op offload (--no-op-offload turns it off): large CPU-resident matmuls run on the GPU
    op_offload: bool = True
    # the KV cache on the layers' devices (-nkvo turns it off: host memory, attention on the CPU)
    kv_offload: bool = True
    # a model with sliding-window layers (Gemma 2/3, gpt-oss): their cache holds the whole context (--swa-full)
    # rather than the window and a ubatch
    swa_full: bool = False
    # llama.cpp's eval callback (cb_eval): sees the graph's named tensors as they are computed (pykvq.api.capture)
    observer: TensorObserver | None = None

    def __post_init__(self) -> None:
        # llama_context_params holds 32-bit counts (a Python int past them is an OverflowError), and llama.cpp takes
        # some out-of-range ones only to fail later with a message that contradicts the settings
        for name, flag, least in (("n_ctx", "-c", 0), ("n_batch", "-b", 1), ("n_ubatch", "-ub", 1),
                                  ("n_threads", "-t", 1), ("n_seq_max", "-np", 1)):
            value = getattr(self, name)
            if value < least:
                meaning = " (0: the model's training context)" if least == 0 else ""
                raise ValueError(f"{flag}/{name} must be {least} or more{meaning}, got {value}")
            if value > INT32_MAX:
                raise ValueError(f"{flag}/{name} must be at most {INT32_MAX}, got {value}")


@dataclass(frozen=True)
class KvMemory:
    """What a context's KV cache allocated, against f16 K and V for the same cells."""

    bytes: int
    f16_bytes: int
    n_elements: int
    n_cells: int
    n_layers: int
    n_seq_cells: int  # what one sequence can hold: fewer than n_cells with streams or a unified kivi cache
    # of bytes, the sliding-window cache's, and its cells (a model with sliding-window layers; else 0)
    swa_bytes: int = 0
    swa_n_cells: int = 0
    swa_n_elements: int = 0

    @property
    def bits_per_element(self) -> float:
        return 8.0 * self.bytes / self.n_elements

    @property
    def ratio_to_f16(self) -> float:
        return self.bytes / self.f16_bytes

    @property
    def swa_bits_per_element(self) -> float:
        """The sliding-window cache's alone (0 without one)."""
        return 8.0 * self.swa_bytes / self.swa_n_elements if self.swa_n_elements else 0.0

    def held_bytes(self, n_held: int, n_fp16_cells: int) -> float:
        """What a single sequence's cache holds with ``n_held`` of its cells used (prompt selection leaves fewer
        cells than positions): the quantized cells it uses, and the fp16 sinks and ring it keeps whatever."""
        elements_per_cell = self.n_elements / self.n_cells
        fixed = n_fp16_cells * elements_per_cell * 2
        return (self.bytes - fixed) / self.n_cells * n_held + fixed

    @property
    def global_bits_per_element(self) -> float:
        """The cache of the global layers (every layer's, without sliding-window ones; 0 without any: LFM2's
        attention layers all slide)."""
        n_global = self.n_elements - self.swa_n_elements
        return 8.0 * (self.bytes - self.swa_bytes) / n_global if n_global else 0.0


@dataclass(frozen=True)
class Timings:
    """Tokens evaluated as prompt and as generation, and llama.cpp's compute time of each."""

    prompt_ms: float
    n_prompt: int
    decode_ms: float
    n_decode: int

    @staticmethod
    def _rate(n: int, ms: float) -> float:
        return 1e3 * n / ms if ms > 0 else 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        return self._rate(self.n_prompt, self.prompt_ms)

    @property
    def decode_tokens_per_s(self) -> float:
        return self._rate(self.n_decode, self.decode_ms)

    def __add__(self, other: Timings) -> Timings:
        return Timings(self.prompt_ms + other.prompt_ms, self.n_prompt + other.n_prompt,
                       self.decode_ms + other.decode_ms, self.n_decode + other.n_decode)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


# The kivi settings are process-wide in the C API (llama_context_params must keep upstream's layout), and
# a cache reads them when it is created: creation sets them and restores the previous ones under this lock.
_context_lock = threading.Lock()


@contextmanager
def kvq_params_applied(kv: KvConfig) -> Iterator[None]:
    """Hold ``kv``'s kivi settings in the C API while a context is created in this block."""
    with _context_lock:
        previous, previous_layers, previous_swa = native.kvq_params(), native.kvq_layer_types(), native.swa_types()
        previous_clip, previous_rotation = native.kvq_clip(), native.kvq_rotation()
        previous_dither = native.kvq_dither()
        try:
            native.set_kvq_params(kv.kvq_params())
            native.set_kvq_layer_types(kv.layers or "")
            native.set_kvq_clip(kv.clip or "")
            native.set_kvq_rotation(kv.rotation_spec)
            native.set_kvq_dither(kv.dither or "")
            native.set_swa_type_name(kv.type_swa)
            yield
        finally:
            native.set_kvq_params(previous)
            native.set_kvq_layer_types(previous_layers)
            native.set_kvq_clip(previous_clip)
            native.set_kvq_rotation(previous_rotation)
            native.set_kvq_dither(previous_dither)
            native.set_swa_types(*previous_swa)


def context_params(lib: native.Libraries, config: ContextConfig):
    """``config`` as llama_context_params, checked where llama.cpp would abort or silently change it."""
    if config.flash_attn not in FLASH_ATTN:
        raise LlamaError(f"-fa must be one of {', '.join(FLASH_ATTN)}, got {config.flash_attn!r}")
    kv = config.kv
    flash_attn = config.flash_attn
    if kv.needs_flash_attn:
        if flash_attn == "off":
            raise LlamaError(f"{kv.flash_attn_reason}: use -fa on (or auto)")
        flash_attn = "on"
    params = lib.llama.llama_context_default_params()
    params.n_ctx = config.n_ctx
    # n_ctx 0: the model's training context (llama.cpp clamps the batch to it)
    params.n_batch = min(config.n_batch, config.n_ctx) if config.n_ctx else config.n_batch
    params.n_ubatch = min(config.n_ubatch, params.n_batch)
    params.n_threads = params.n_threads_batch = config.n_threads
    params.n_seq_max = config.n_seq_max
    if params.n_batch < config.n_seq_max:
        # llama.cpp reserves one output per sequence within a batch, and aborts when they do not fit
        raise LlamaError(f"a batch of {params.n_batch} tokens (-b, at most -c) cannot hold one token of each of "
                         f"{config.n_seq_max} sequences (-np): raise -b to at least {config.n_seq_max}")
    params.kv_unified = config.kv_unified
    params.op_offload = config.op_offload
    params.offload_kqv = config.kv_offload
    params.swa_full = config.swa_full
    params.flash_attn_type = FLASH_ATTN[flash_attn]
    params.no_perf = False
    params.type_k = kv_types.type_id(kv.type_k)
    params.type_v = kv_types.type_id(kv.type_v)
    if config.observer is not None:
        params.cb_eval = config.observer.c_callback()
    return params


class _Handle:
    """An object libllama allocated: freed by close() or at the end of a with block. Every use reads the pointer
    through ``_ptr``, which raises LlamaError once it is freed: llama.cpp would read freed memory."""

    _closed_message: ClassVar[str]
    _handle = None

    @property
    def _ptr(self):
        if self._handle is None:
            raise LlamaError(self._closed_message)
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def _free(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self._handle is not None:
            self._free()
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LayerPlacement(Protocol):
    """Where a model's layers go, as pykvq.fit_placement decides (its Placement): it sets llama_model_params."""

    def apply(self, mparams) -> None: ...


class Model(_Handle):
    """A GGUF model loaded by libllama. ``close()`` closes the contexts made from it first (they use its weights
    and vocabulary); a closed model's or context's methods raise LlamaError."""

    _closed_message = "the model is closed: load it again (Model(path)) to use it"

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int | LayerPlacement = 0, rpc: str | None = None,
                 vocab_only: bool = False, metadata_only: bool = False) -> None:
        """n_gpu_layers: layers on the GPU (-ngl; -1 every one), or where pykvq.fit_placement put them; rpc: RPC
        servers as extra devices, HOST:PORT[,...] (--rpc); vocab_only: load the vocabulary alone (to tokenize);
        metadata_only: the hyperparameters and vocabulary, no weights (to check settings against the model's shape
        and tokenize). Neither can make a context."""
        self.path = Path(path)
        check_readable_file(self.path, "model")
        if rpc:
            add_rpc_servers(rpc)
        self._lib = native.libs()
        sink()
        params = self._lib.llama.llama_model_default_params()
        if isinstance(n_gpu_layers, int):
            check_gpu_layers(n_gpu_layers)
            params.n_gpu_layers = n_gpu_layers
        else:
            n_gpu_layers.apply(params)
        params.vocab_only = vocab_only
        if metadata_only:
            params.no_alloc = True
            params.load_mode = LLAMA_LOAD_MODE_NONE
        # what the model was loaded without, which no context can run on
        self._no_weights = "vocab_only" if vocab_only else "metadata_only" if metadata_only else None
        self._contexts: weakref.WeakSet[Context] = weakref.WeakSet()
        ptr = _call(self._lib.llama.llama_model_load_from_file, str(self.path).encode(), params)
        if ptr == self._lib.ffi.NULL:
            raise _fail(f"cannot load model {self.path}")
        self._handle = ptr

    def _free(self) -> None:
        for context in list(self._contexts):
            context.close()
        self._lib.llama.llama_model_free(self._ptr)

    @property
    def _vocab(self):
        return self._lib.llama.llama_model_get_vocab(self._ptr)

    @property
    def n_layer(self) -> int:
        return self._lib.llama.llama_model_n_layer(self._ptr)

    @property
    def n_ctx_train(self) -> int:
        return self._lib.llama.llama_model_n_ctx_train(self._ptr)

    @property
    def n_swa(self) -> int:
        """The sliding window (or chunk) of the model's sliding-window layers; 0 without any."""
        return self._lib.llama.llama_model_n_swa(self._ptr)

    @property
    def n_vocab(self) -> int:
        return self._lib.llama.llama_vocab_n_tokens(self._vocab)

    @property
    def description(self) -> str:
        buf = self._lib.ffi.new("char[]", 256)
        self._lib.llama.llama_model_desc(self._ptr, buf, 256)
        return self._lib.ffi.string(buf).decode(errors="replace")

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode()
        capacity = len(data) + 8
        while True:
            tokens = self._lib.ffi.new("llama_token[]", capacity)
            n = _call(self._lib.llama.llama_tokenize, self._vocab, data, len(data), tokens, capacity, add_special,
                      parse_special)
            if n >= 0:
                return list(tokens[0:n])
            if n == -(2**31):
                raise _fail("cannot tokenize the text")
            capacity = -n

    def check_tokens(self, tokens: Iterable[int]) -> None:
        """ValueError for a token id outside the vocabulary: llama.cpp aborts the process on one."""
        n_vocab = self.n_vocab
        for token in tokens:
            if not 0 <= token < n_vocab:
                raise ValueError(f"token id {token} is not in the vocabulary of {self.path.name}: it has {n_vocab} "
                                 f"tokens, ids 0 to {n_vocab - 1}")

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        self.check_tokens((token,))
        capacity = 32
        while True:
            buf = self._lib.ffi.new("char[]", capacity)
            n = self._lib.llama.llama_token_to_piece(self._vocab, token, buf, capacity, 0, special)
            if n >= 0:
                return self._lib.ffi.buffer(buf, n)[:]
            capacity = -n

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        return b"".join(self.token_to_piece(t, special) for t in tokens).decode(errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.llama.llama_vocab_is_eog(self._vocab, token))

    def eog_tokens(self) -> list[int]:
        """The vocabulary's end-of-generation tokens (EOS, EOT, ...)."""
        return [token for token in range(self.n_vocab) if self.is_eog(token)]

    def sampler(self, settings: SamplerSettings = SamplerSettings()) -> Sampler:
        """A Sampler for this model's vocabulary (which --ignore-eos needs)."""
        if not settings.ignore_eos:
            return Sampler(settings)
        return Sampler(settings, self.eog_tokens(), self.n_vocab)

    @property
    def chat_template(self) -> str | None:
        tmpl = self._lib.llama.llama_model_chat_template(self._ptr, self._lib.ffi.NULL)
        return None if tmpl == self._lib.ffi.NULL else self._lib.ffi.string(tmpl).decode(errors="replace")

    def apply_chat_template(self, messages: Sequence[ChatMessage], add_assistant: bool = True) -> str:
        """The prompt text for a conversation, formatted with the model's own chat template."""
        tmpl = self.chat_template
        if tmpl is None:
            raise LlamaError(f"{self.path.name} has no chat template (tokenizer.chat_template)")
        ffi = self._lib.ffi
        keep = [(ffi.new("char[]", m.role.encode()), ffi.new("char[]", m.content.encode())) for m in messages]
        chat = ffi.new("llama_chat_message[]", len(keep))
        for slot, (role, content) in zip(chat, keep, strict=True):
            slot.role, slot.content = role, content
        capacity = 2 * sum(len(m.content) + len(m.role) for m in messages) + 256
        while True:
            buf = ffi.new("char[]", capacity)
            n = self._lib.llama.llama_chat_apply_template(tmpl.encode(), chat, len(keep), add_assistant, buf,
                                                          capacity)
            if n < 0:
                raise LlamaError(f"llama.cpp does not support the chat template of {self.path.name}")
            if n <= capacity:
                return ffi.buffer(buf, n)[:].decode(errors="replace")
            capacity = n

    def context(self, config: ContextConfig = ContextConfig()) -> Context:
        """A context on this model; closing the model closes it too."""
        return Context(self, config)

    def generate(self, prompt: str, n_predict: int = 128, sampling: SamplerSettings = SamplerSettings(),
                 kv: KvConfig = KvConfig(), n_ctx: int = 4096) -> Iterator[str]:
        """Stream the text generated after ``prompt`` in a fresh context."""
        with self.context(ContextConfig(n_ctx=n_ctx, kv=kv)) as ctx:
            yield from ctx.generate_text(self.tokenize(prompt), n_predict, self.sampler(sampling))


POS_MAX = 2**31 - 1  # llama_pos is an int32_t


def _check_positions(seq: int, start: int, n_tokens: int) -> None:
    """Refuse tokens whose positions would pass llama_pos (a state may hold a cell at its largest value)."""
    if start + n_tokens - 1 > POS_MAX:
        raise LlamaError(f"sequence {seq}: {n_tokens} more tokens from position {start} pass the largest position "
                         f"llama.cpp takes ({POS_MAX})")


class Context(_Handle):
    """A llama_context: its KV cache and its logits. ``eval``, ``generate_*``, ``truncate`` and the whole-state
    methods work on sequence 0; with ``n_seq_max`` > 1, ``eval_seqs`` and the ``seq_*`` methods reach the others.
    It lives until its own ``close()`` or its model's, whichever comes first."""

    _closed_message = "the context is closed (closing its model closes it too): create another with Model.context()"

    def __init__(self, model: Model, config: ContextConfig) -> None:
        self.model = model
        self.config = config
        self._lib = model._lib
        self.n_past = 0
        self.context_full = False  # generation stopped because the context filled up
        self.generation = Timings(0.0, 0, 0.0, 0)  # what generate_tokens evaluated
        self._handle = self._create(config)
        # one batch for the context's life: generation decodes token by token
        self._batch = self._lib.llama.llama_batch_init(self._lib.llama.llama_n_batch(self._ptr), 0, 1)
        model._contexts.add(self)

    def _create(self, config: ContextConfig):
        lib = self._lib
        if self.model._no_weights:
            raise LlamaError(f"cannot create a context: {self.model.path.name} was loaded with "
                             f"{self.model._no_weights}=True, without weights; load it without that to evaluate")
        if lib.llama.llama_model_has_encoder(self.model._ptr):
            # decoding without llama_encode first aborts the process in llama.cpp
            raise LlamaError(f"cannot create the context: {self.model.path.name} is an encoder-decoder model (T5), "
                             "and pykvq runs decoder-only models; llama.cpp's llama-completion runs it")
        params = context_params(lib, config)
        with kvq_params_applied(config.kv):
            ptr = _call(lib.llama.llama_init_from_model, self.model._ptr, params)
        if ptr == lib.ffi.NULL:
            raise _fail("cannot create the context")
        return ptr

    def _free(self) -> None:
        self._lib.llama.llama_batch_free(self._batch)
        self._lib.llama.llama_free(self._ptr)

    @property
    def n_ctx(self) -> int:
        return self._lib.llama.llama_n_ctx(self._ptr)

    @property
    def n_seq_cells(self) -> int:
        """The cells one sequence can hold: n_ctx, or its share with streams or a unified kivi cache (checked
        before decoding: a kivi cache cannot always take back the batches of a call that fails halfway)."""
        info = self._lib.ffi.new("struct llama_kvq_memory_info *")
        if not self._lib.llama.llama_kvq_memory_info(self._ptr, info):
            return self.n_ctx
        return info.n_seq_cells

    def eval(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append ``tokens`` to the sequence; returns the logits of the last token, or of every token
        (shape [len(tokens), n_vocab]) with ``all_logits``."""
        if not tokens:
            raise ValueError("nothing to evaluate: no tokens")
        if self.seq_cells(0) + len(tokens) > self.n_seq_cells:
            raise LlamaError(f"{len(tokens)} more tokens do not fit the context: {self.seq_cells(0)} of the "
                             f"{self.n_seq_cells} cells of a sequence are used (raise -c)")
        _check_positions(0, self.n_past, len(tokens))
        self.model.check_tokens(tokens)
        lib = self._lib
        n_vocab = self.model.n_vocab
        n_batch = lib.llama.llama_n_batch(self._ptr)
        out = np.empty((len(tokens) if all_logits else 1, n_vocab), dtype=np.float32)
        batch = self._batch
        for start in range(0, len(tokens), n_batch):
            chunk = tokens[start:start + n_batch]
            last_chunk = start + len(chunk) == len(tokens)
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = self.n_past + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = all_logits or (last_chunk and i == len(chunk) - 1)
            status = _call(lib.llama.llama_decode, self._ptr, batch)
            if status != 0:
                raise self._undo_eval({0: self.n_past - start}, status)
            self.n_past += len(chunk)
            rows = range(len(chunk)) if all_logits else ([len(chunk) - 1] if last_chunk else [])
            for i in rows:
                logits = lib.llama.llama_get_logits_ith(self._ptr, i)
                out[start + i if all_logits else 0] = np.frombuffer(
                    lib.ffi.buffer(logits, 4 * n_vocab), dtype=np.float32)
        return out if all_logits else out[0]

    def _undo_eval(self, starts: Mapping[int, int], status: int) -> LlamaError:
        """The error of a failed llama_decode, once the batches this evaluation decoded before it are removed
        again (llama.cpp removes those of the failed one): an evaluation that fails adds nothing. Where the cache
        cannot remove them (a kivi removal past the window's slack), the positions follow what it holds, and the
        error says what each sequence kept."""
        error = _fail(f"llama_decode failed with status {status}")
        for seq, start in starts.items():
            self._lib.llama.llama_memory_seq_rm(self._mem, seq, start, -1)
        problems = sink().take_problems()
        self._sync_n_past()
        kept = {seq: n for seq, start in starts.items() if (n := self.seq_len(seq)) > start}
        if not kept:
            return error
        held = ", ".join(f"sequence {seq} keeps {n - starts[seq]} of them ({n} tokens in all)"
                         for seq, n in kept.items())
        reason = f" ({problems[0]})" if problems else ""
        return LlamaError(f"{error}; the tokens decoded before the failure could not be removed again{reason}: "
                          f"{held}")

    def check_fits(self, prompt: Sequence[int]) -> None:
        free = self.n_seq_cells - self.seq_cells(0)
        if len(prompt) > free:
            raise LlamaError(f"the prompt is {len(prompt)} tokens, the context has {free} "
                             "free cells (raise -c or shorten the prompt)")

    def generate_tokens(self, prompt: Sequence[int], n_predict: int, sampler: Sampler) -> Iterator[int]:
        """Evaluate ``prompt``, then yield up to ``n_predict`` sampled tokens (-1: until end of generation or
        a full context, which sets ``context_full``). Raises LlamaError when the prompt itself does not fit."""
        self.check_fits(prompt)
        start = self._compute_ms()
        self.eval(prompt)
        self.generation += Timings(self._compute_ms() - start, len(prompt), 0.0, 0)
        produced = 0
        while n_predict < 0 or produced < n_predict:
            token = sampler.sample(self._ptr)
            if self.model.is_eog(token):
                return
            if self.n_past >= self.n_seq_cells:
                self.context_full = True
                return
            # evaluated before it is handed out, so that the cache always holds everything yielded
            start = self._compute_ms()
            self.eval([token])
            self.generation += Timings(0.0, 0, self._compute_ms() - start, 1)
            produced += 1
            yield token

    def _compute_ms(self) -> float:
        """llama.cpp's compute time so far; its own counters call a one-token prompt a generated token, so
        generate_tokens keeps its own split (``generation``)."""
        perf = self._lib.llama.llama_perf_context(self._ptr)
        return perf.t_p_eval_ms + perf.t_eval_ms

    def generate_text(self, prompt: Sequence[int], n_predict: int, sampler: Sampler) -> Iterator[str]:
        """Like generate_tokens, as text pieces; a character split across tokens comes out whole."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for token in self.generate_tokens(prompt, n_predict, sampler):
            if piece := decoder.decode(self.model.token_to_piece(token)):
                yield piece
        if tail := decoder.decode(b"", final=True):
            yield tail

    @property
    def can_shift(self) -> bool:
        """Whether the cache supports a context shift (RoPE re-rotation of K); kivi caches do not."""
        llama = self._lib.llama
        return bool(llama.llama_memory_can_shift(llama.llama_get_memory(self._ptr)))

    def truncate(self, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` of the sequence (chat regeneration, speculative-decoding rollback)."""
        if not 0 <= n_tokens <= self.n_past:
            raise ValueError(f"cannot keep {n_tokens} tokens of a sequence of {self.n_past}")
        llama = self._lib.llama
        if not _call(llama.llama_memory_seq_rm, llama.llama_get_memory(self._ptr), 0, n_tokens, -1):
            raise _fail(f"cannot remove tokens {n_tokens}.. of {self.n_past}")
        # the cache decides: after a removal that left a hole (seq_rm of an earlier range) less may remain
        self._sync_n_past()

    # several sequences

    @property
    def _mem(self):
        return self._lib.llama.llama_get_memory(self._ptr)

    def _seq(self, seq: int, what: str = "sequence", every: bool = False) -> int:
        """``seq`` when this context holds it (-1 too with ``every``): llama.cpp aborts on any other id."""
        if not (-1 if every else 0) <= seq < self.config.n_seq_max:
            held = f"0..{self.config.n_seq_max - 1}" if self.config.n_seq_max > 1 else "only 0"
            raise ValueError(f"{what} {seq} is not one of this context's sequences ({held}; -np / n_seq_max "
                             f"{self.config.n_seq_max}){', or -1 for all' if every else ''}")
        return seq

    def seq_len(self, seq: int) -> int:
        """Tokens of sequence ``seq`` in the cache (its last position + 1)."""
        return self._lib.llama.llama_memory_seq_pos_max(self._mem, self._seq(seq)) + 1

    def seq_cells(self, seq: int) -> int:
        """Cells sequence ``seq`` holds: its positions, or fewer once prompt selection (KvConfig.select) kept part
        of its prompt (in the global cache of a model with sliding-window layers)."""
        cells = self._lib.llama.llama_kvq_seq_cells(self._ptr, self._seq(seq))
        return self.seq_len(seq) if cells < 0 else cells

    def _sync_n_past(self) -> None:
        self.n_past = self.seq_len(0)

    def eval_seqs(self, feeds: Mapping[int, Sequence[int]]) -> dict[int, np.ndarray]:
        """Append ``feeds[seq]`` to each sequence, all in the same batches (sequence after sequence, split at
        n_batch); returns the logits of each sequence's last new token."""
        lib = self._lib
        n_vocab = self.model.n_vocab
        n_batch = lib.llama.llama_n_batch(self._ptr)
        for tokens in feeds.values():
            self.model.check_tokens(tokens)
        items = []  # (seq, position, token, wants its logits)
        starts = {seq: self.seq_len(seq) for seq in feeds}
        room = self.n_seq_cells
        for seq, tokens in feeds.items():
            start = starts[seq]
            used = self.seq_cells(seq)
            if used + len(tokens) > room:
                raise LlamaError(f"sequence {seq}: {len(tokens)} more tokens do not fit its {used} used cells")
            _check_positions(seq, start, len(tokens))
            items += [(seq, start + i, token, i == len(tokens) - 1) for i, token in enumerate(tokens)]
        out: dict[int, np.ndarray] = {}
        batch = self._batch
        for start in range(0, len(items), n_batch):
            chunk = items[start:start + n_batch]
            batch.n_tokens = len(chunk)
            for i, (seq, pos, token, last) in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = last
            status = _call(lib.llama.llama_decode, self._ptr, batch)
            if status != 0:
                raise self._undo_eval(starts, status)
            for i, (seq, _, _, last) in enumerate(chunk):
                if last:
                    logits = lib.llama.llama_get_logits_ith(self._ptr, i)
                    out[seq] = np.frombuffer(lib.ffi.buffer(logits, 4 * n_vocab), dtype=np.float32).copy()
        self._sync_n_past()
        return out

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Remove positions [p0, p1) of sequence ``seq`` (-1: from the start, to the end; ``seq`` -1: all)."""
        if not _call(self._lib.llama.llama_memory_seq_rm, self._mem, self._seq(seq, every=True), p0, p1):
            raise _fail(f"cannot remove positions [{p0}, {p1}) of sequence {seq}")
        self._sync_n_past()

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make sequence ``dst`` a copy of positions [p0, p1) of ``src`` (-1: from the start, to the end)."""
        self._seq(src, "source sequence")
        self._seq(dst, "destination sequence")
        if self.config.n_seq_max > 1 and not self.config.kv_unified and src != dst:
            # per-sequence streams copy a whole stream (llama.cpp aborts on a part of one)
            if p0 > 0 or 0 <= p1 < self.seq_len(src):
                raise ValueError(f"cannot copy positions [{p0}, {p1}) of sequence {src}: a cache of per-sequence "
                                 "streams copies whole sequences only (p0 = p1 = -1), a unified one (--kv-unified) "
                                 "copies prefixes too")
            p0 = p1 = -1
        _call(self._lib.llama.llama_memory_seq_cp, self._mem, src, dst, p0, p1)
        self._sync_n_past()
        if problems := sink().take_problems():
            raise LlamaError(f"cannot copy positions [{p0}, {p1}) of sequence {src} to {dst}: {problems[0]}")

    def seq_keep(self, seq: int) -> None:
        """Remove every sequence but ``seq``."""
        self._seq(seq)
        if self.config.kv_unified or self.config.n_seq_max == 1:
            self._lib.llama.llama_memory_seq_keep(self._mem, seq)
        else:
            # llama.cpp's seq_keep looks at the stream of ``seq`` only: the others are cleared here
            for other in range(self.config.n_seq_max):
                if other != seq:
                    self._lib.llama.llama_memory_seq_rm(self._mem, other, -1, -1)
        self._sync_n_past()

    def save_seq_state(self, seq: int) -> bytes:
        """The state of one sequence, as llama_state_seq_get_data writes it."""
        llama = self._lib.llama
        size = llama.llama_state_seq_get_size(self._ptr, self._seq(seq))
        buf = self._lib.ffi.new("uint8_t[]", size)
        written = _call(llama.llama_state_seq_get_data, self._ptr, buf, size, seq)
        if written == 0:
            raise _fail(f"cannot save sequence {seq}")
        return self._lib.ffi.buffer(buf, written)[:]

    def load_seq_state(self, state: bytes, seq: int) -> None:
        """Restore a sequence saved by save_seq_state into sequence ``seq`` (replacing it)."""
        # llama.cpp leaves the sequence as it was when the state holds no cells: it is replaced here in any case
        self._lib.llama.llama_memory_seq_rm(self._mem, self._seq(seq), -1, -1)
        n_read = _call(self._lib.llama.llama_state_seq_set_data, self._ptr, state, len(state), seq)
        self._check_loaded(n_read, len(state), f"cannot load the state into sequence {seq}",
                           lambda: self._lib.llama.llama_memory_seq_rm(self._mem, seq, -1, -1))

    def _check_loaded(self, n_read: int, size: int, what: str, forget: Callable[[], object]) -> None:
        """After llama.cpp read ``n_read`` bytes of a state of ``size`` (0: refused)."""
        if 0 < n_read < size:
            # bytes past the state's end (a corrupt count, states run together): not a state this API wrote, so
            # what llama.cpp took from it goes too, as after any refused load
            forget()
        # a refused load may have cleared the cache or the sequence: the positions follow what it holds
        self._sync_n_past()
        if n_read == 0:
            raise _fail(what)
        if n_read != size:
            raise LlamaError(f"{what}: {size - n_read} of its {size} bytes lie past the state's end")

    def save_state(self) -> bytes:
        """The context's state (KV cache, logits), as llama_state_get_data writes it."""
        llama = self._lib.llama
        size = llama.llama_state_get_size(self._ptr)
        buf = self._lib.ffi.new("uint8_t[]", size)
        written = _call(llama.llama_state_get_data, self._ptr, buf, size)
        if written == 0:
            raise _fail("cannot save the context's state")
        return self._lib.ffi.buffer(buf, written)[:]

    def load_state(self, state: bytes) -> None:
        """Restore a state saved by save_state (a context of the same model and KV settings)."""
        n_read = _call(self._lib.llama.llama_state_set_data, self._ptr, state, len(state))
        self._check_loaded(n_read, len(state), "cannot load the state",
                           lambda: self._lib.llama.llama_memory_clear(self._mem, True))

    def memory(self) -> KvMemory:
        info = self._lib.ffi.new("struct llama_kvq_memory_info *")
        if not self._lib.llama.llama_kvq_memory_info(self._ptr, info):
            raise LlamaError("this context has no KV cache")
        return KvMemory(info.bytes, info.f16_bytes, info.n_elements, info.n_cells, info.n_layers_kv,
                        info.n_seq_cells, info.swa_bytes, info.swa_n_cells, info.swa_n_elements)

    def timings(self) -> Timings:
        perf = self._lib.llama.llama_perf_context(self._ptr)
        return Timings(perf.t_p_eval_ms, perf.n_p_eval, perf.t_eval_ms, perf.n_eval)


def gpu_offload_supported() -> bool:
    """A device that takes layers: a GPU of this build, or an RPC server added with add_rpc_servers."""
    return bool(devices.offload_devices())


def check_gpu_layers(n_gpu_layers: int) -> None:
    """LlamaError where layers are asked of a GPU that is not there (llama.cpp would keep them on the CPU)."""
    if n_gpu_layers != 0 and not gpu_offload_supported():
        raise LlamaError(f"-ngl {n_gpu_layers} asks for GPU layers, but {_no_gpu_reason()}")


def add_rpc_servers(servers: str) -> None:
    """RPC servers (HOST:PORT[,...], each running ggml-rpc-server) as devices for -ngl, as llama.cpp's --rpc."""
    try:
        devices.add_rpc_servers(servers)
    except devices.DeviceError as e:
        raise LlamaError(str(e)) from None


def _no_gpu_reason() -> str:
    if "CUDA" not in native.backends():
        return "this pykvq build has no GPU backend (rebuild with PYKVQ_CUDA=ON, or offload to an RPC server: --rpc)"
    return "the CUDA backend finds no GPU here (no NVIDIA driver or device)"
