"""cffi (ABI mode) bindings to the built libllama, libggml and pykvq's C API extension."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
from cffi import FFI

from pykvq import paths
from pykvq.bindings.cdef import LLAMA_CDEF

# enum ggml_type is passed as int: same size and calling convention on every platform we build for
_CDEF = """
    const char * llama_kvq_version(void);
    struct llama_kvq_params { int32_t window; int32_t n_sink; bool rotate; int32_t n_rollback; float select_hh;
                              float select_recent; int32_t select_observe; float select_depth; };
    struct llama_kvq_params llama_kvq_default_params(void);
    size_t       llama_kvq_n_cache_types(void);
    int          llama_kvq_cache_type(size_t i);
    const char * llama_print_system_info(void);

    struct ggml_type_traits {
        const char * type_name;
        int64_t      blck_size;
        int64_t      blck_size_interleave;
        size_t       type_size;
        bool         is_quantized;
        void (*to_float)(const void * x, float * y, int64_t k);
        void (*from_float_ref)(const float * x, void * y, int64_t k);
    };
    const struct ggml_type_traits * ggml_get_type_traits(int type);
    size_t ggml_quantize_chunk(int type, const float * src, void * dst, int64_t start, int64_t nrows,
                               int64_t n_per_row, const float * imatrix);
    bool   ggml_validate_row_data(int type, const void * data, size_t nbytes);
    size_t ggml_row_size(int type, int64_t ne);

    int32_t ggml_kvq_ring_size(int32_t window);

    const char * ggml_get_name(const void * tensor);
    size_t       ggml_nbytes(const void * tensor);
    int64_t      ggml_nelements(const void * tensor);
    int64_t      ggml_nrows(const void * tensor);
    void         ggml_backend_tensor_get(const void * tensor, void * data, size_t offset, size_t size);

    const char * ggml_type_name(int type);
    int64_t      ggml_blck_size(int type);
    size_t       ggml_type_size(int type);

    typedef struct ggml_backend_reg * ggml_backend_reg_t;
    size_t             ggml_backend_reg_count(void);
    ggml_backend_reg_t ggml_backend_reg_get(size_t index);
    const char *       ggml_backend_reg_name(ggml_backend_reg_t reg);
    ggml_backend_reg_t ggml_backend_reg_by_name(const char * name);
    void *             ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);
    void               ggml_backend_register(ggml_backend_reg_t reg);

    typedef struct ggml_backend_device * ggml_backend_dev_t;
    size_t             ggml_backend_dev_count(void);
    ggml_backend_dev_t ggml_backend_dev_get(size_t index);
    const char *       ggml_backend_dev_name(ggml_backend_dev_t device);
    const char *       ggml_backend_dev_description(ggml_backend_dev_t device);
    int                ggml_backend_dev_type(ggml_backend_dev_t device);
    void               ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
"""


# the C API's int32_t fields
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True)
class Libraries:
    ffi: FFI
    llama: object
    ggml: object
    ggml_base: object
    common: object  # libllama-common: llama_kvq_fit_params


@cache
def libs() -> Libraries:
    ffi = FFI()
    ffi.cdef(_CDEF)
    ffi.cdef(LLAMA_CDEF)
    # ggml-base and ggml first: libllama finds them through its RPATH, but the handles are ours
    try:
        ggml_base = ffi.dlopen(str(paths.library("ggml-base")))
        ggml = ffi.dlopen(str(paths.library("ggml")))
        llama = ffi.dlopen(str(paths.library("llama")))
        common = ffi.dlopen(str(paths.library("llama-common")))
    except OSError as e:
        if "libcuda.so" in str(e):
            raise OSError("this pykvq is a CUDA build and needs the NVIDIA driver (libcuda.so.1), which this machine "
                          "lacks: install the driver, or build pykvq without PYKVQ_CUDA") from None
        raise
    return Libraries(ffi, llama, ggml, ggml_base, common)


def _str(ptr) -> str:
    return libs().ffi.string(ptr).decode()


@dataclass(frozen=True)
class GgmlType:
    id: int
    name: str
    block_size: int
    type_size: int

    @property
    def bits_per_element(self) -> float:
        return 8.0 * self.type_size / self.block_size


def ggml_type(type_id: int) -> GgmlType:
    base = libs().ggml_base
    return GgmlType(type_id, _str(base.ggml_type_name(type_id)), base.ggml_blck_size(type_id),
                    base.ggml_type_size(type_id))


def kv_cache_types() -> list[GgmlType]:
    """The types the patched llama.cpp accepts for K and V (what `-ctk`/`-ctv` list)."""
    llama = libs().llama
    return [ggml_type(llama.llama_kvq_cache_type(i)) for i in range(llama.llama_kvq_n_cache_types())]


def backends() -> list[str]:
    ggml = libs().ggml
    return [_str(ggml.ggml_backend_reg_name(ggml.ggml_backend_reg_get(i)))
            for i in range(ggml.ggml_backend_reg_count())]


def extension_version() -> str:
    return _str(libs().llama.llama_kvq_version())


def system_info() -> str:
    return _str(libs().llama.llama_print_system_info())


def quantize_rows(type_id: int, rows: np.ndarray) -> np.ndarray:
    """Quantize float32 rows with ggml_quantize_chunk (the reference path); returns the raw bytes."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if rows.ndim != 2:
        raise ValueError("rows must be a 2-D array")
    lib = libs()
    n_rows, n_per_row = rows.shape
    out = np.zeros(n_rows * lib.ggml_base.ggml_row_size(type_id, n_per_row), dtype=np.uint8)
    lib.ggml_base.ggml_quantize_chunk(type_id, lib.ffi.from_buffer("float[]", rows), lib.ffi.from_buffer(out),
                                      0, n_rows, n_per_row, lib.ffi.NULL)
    return out.reshape(n_rows, -1)


def dequantize_rows(type_id: int, data: np.ndarray, n_per_row: int) -> np.ndarray:
    """Dequantize raw rows with the type's to_float."""
    lib = libs()
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    row_size = lib.ggml_base.ggml_row_size(type_id, n_per_row)
    n_rows = data.size // row_size
    out = np.zeros((n_rows, n_per_row), dtype=np.float32)
    to_float = lib.ggml_base.ggml_get_type_traits(type_id).to_float
    for r in range(n_rows):
        to_float(lib.ffi.from_buffer(data[r * row_size:(r + 1) * row_size]),
                 lib.ffi.cast("float *", lib.ffi.from_buffer(out[r])), n_per_row)
    return out


def validate_row_data(type_id: int, data: np.ndarray) -> bool:
    lib = libs()
    data = np.ascontiguousarray(data, dtype=np.uint8)
    return bool(lib.ggml_base.ggml_validate_row_data(type_id, lib.ffi.from_buffer(data), data.size))


def kvq_ring_size(window: int) -> int:
    """fp16 ring cells a kivi layer keeps for a recent window of ``window`` tokens."""
    return int(libs().ggml_base.ggml_kvq_ring_size(window))


# a window or sink count that takes the model's kvq.window / kvq.sinks, else the default (LLAMA_KVQ_FROM_MODEL)
KVQ_FROM_MODEL = -1


@dataclass(frozen=True)
class KvqParams:
    window: int
    n_sink: int
    rotate: bool
    n_rollback: int = 0
    # MiniKV's prompt selection: heavy-hitter and recent shares of a prompt (0, 0: off), and the prompt's last
    # tokens whose attention picks the heavy hitters (0: all of them)
    select_hh: float = 0.0
    select_recent: float = 0.0
    select_observe: int = 0
    # MiniKV's pyramid depth: the heavy-hitter share falls linearly from the bottom layer to the top (1: none)
    select_depth: float = 1.0


def kvq_default_params() -> KvqParams:
    return _kvq_params(libs().llama.llama_kvq_default_params())


def _kvq_params(p) -> KvqParams:
    return KvqParams(p.window, p.n_sink, bool(p.rotate), p.n_rollback, p.select_hh, p.select_recent, p.select_observe,
                     p.select_depth)


def kvq_params() -> KvqParams:
    """The kivi settings that KV caches created now would get (process-wide in the C API)."""
    return _kvq_params(libs().llama.llama_kvq_get_params())


def check_token_count(name: str, value: int) -> None:
    """ValueError for a kivi count of tokens (window, sinks, ...) that the C API's int32 cannot hold."""
    if not INT32_MIN <= value <= INT32_MAX:
        raise ValueError(f"the kivi {name} must be at most {INT32_MAX} tokens, got {value}")


def set_kvq_params(params: KvqParams) -> None:
    """Set the process-wide kivi settings; ValueError with the C API's reason when they are invalid."""
    fields = (("window", params.window), ("sink count", params.n_sink), ("rollback depth", params.n_rollback),
              ("observation window", params.select_observe))
    for name, value in fields:
        check_token_count(name, value)
    lib = libs()
    struct = lib.ffi.new("struct llama_kvq_params *", (params.window, params.n_sink, params.rotate, params.n_rollback,
                                                          params.select_hh, params.select_recent,
                                                          params.select_observe, params.select_depth))
    if not lib.llama.llama_kvq_set_params(struct[0]):
        raise ValueError(lib.ffi.string(lib.llama.llama_kvq_last_error()).decode())


def _set_spec(setter, spec: str) -> None:
    lib = libs()
    if not setter(spec.encode()):
        raise ValueError(_str(lib.llama.llama_kvq_last_error()))


def kvq_layer_types() -> str:
    """The process-wide per-layer spec ("" when none: a model's kvq.kv_layers applies)."""
    return _str(libs().llama.llama_kvq_get_layer_types())


def set_kvq_layer_types(spec: str) -> None:
    """Set the process-wide per-layer spec; ValueError naming the offending part when it does not parse."""
    _set_spec(libs().llama.llama_kvq_set_layer_types, spec)


def kvq_clip() -> str:
    """The process-wide clip spec ("" when none: a model's kvq.kv_clip applies)."""
    return _str(libs().llama.llama_kvq_get_clip())


def set_kvq_clip(spec: str) -> None:
    """Set the process-wide clip spec (SKVQ's per-layer clip ratios); ValueError naming the offending part when it
    does not parse."""
    _set_spec(libs().llama.llama_kvq_set_clip, spec)


def resolve_clip(spec: str, n_layer: int) -> tuple[list[float], list[float]]:
    """The K and V clip ratio of each layer under a clip spec; ValueError naming the offending part."""
    lib = libs()
    clip_k = lib.ffi.new("float[]", n_layer)
    clip_v = lib.ffi.new("float[]", n_layer)
    if not lib.llama.llama_kvq_resolve_clip(spec.encode(), n_layer, clip_k, clip_v):
        raise ValueError(_str(lib.llama.llama_kvq_last_error()))
    return list(clip_k), list(clip_v)


def kvq_dither() -> str:
    """The process-wide V dither spec ("" when none: a model's kvq.kv_dither applies)."""
    return _str(libs().llama.llama_kvq_get_dither())


def set_kvq_dither(spec: str) -> None:
    """Set the process-wide V dither spec (a spread for every layer, or per layer); ValueError naming the offending
    part when it does not parse."""
    _set_spec(libs().llama.llama_kvq_set_dither, spec)


def resolve_dither(spec: str, n_layer: int) -> list[float]:
    """The spread of each layer's V dither under a dither spec (0: nearest); ValueError naming the offending part."""
    lib = libs()
    spread_v = lib.ffi.new("float[]", n_layer)
    if not lib.llama.llama_kvq_resolve_dither(spec.encode(), n_layer, spread_v):
        raise ValueError(_str(lib.llama.llama_kvq_last_error()))
    return list(spread_v)


def kvq_rotation() -> str:
    """The process-wide rotation spec ("" when none: a model's kvq.kv_rotate applies, else the params' rotate)."""
    return _str(libs().llama.llama_kvq_get_rotation())


def set_kvq_rotation(spec: str) -> None:
    """Set the process-wide rotation spec (on, off, or per layer); ValueError naming the offending part."""
    _set_spec(libs().llama.llama_kvq_set_rotation, spec)


def resolve_rotation(spec: str, n_layer: int, fallback: bool = False) -> tuple[list[bool], list[bool]]:
    """Whether each layer's K and V are rotated under a rotation spec ("": ``fallback``); ValueError naming the
    offending part."""
    lib = libs()
    rotate_k = lib.ffi.new("bool[]", n_layer)
    rotate_v = lib.ffi.new("bool[]", n_layer)
    if not lib.llama.llama_kvq_resolve_rotation(spec.encode(), n_layer, fallback, rotate_k, rotate_v):
        raise ValueError(_str(lib.llama.llama_kvq_last_error()))
    return list(rotate_k), list(rotate_v)


def swa_types() -> tuple[int, int]:
    """The process-wide types of an iSWA model's sliding-window cache, as set_swa_types takes them back."""
    lib = libs()
    types = lib.ffi.new("int[2]")
    lib.llama.llama_kvq_get_swa_types(types, types + 1)
    return types[0], types[1]


def set_swa_types(type_k: int, type_v: int) -> None:
    lib = libs()
    if not lib.llama.llama_kvq_set_swa_types(type_k, type_v):
        raise ValueError(_str(lib.llama.llama_kvq_last_error()))


def set_swa_type_name(name: str | None) -> None:
    """K and V of the sliding-window cache of an iSWA model by type name; None follows the context's types."""
    lib = libs()
    if not lib.llama.llama_kvq_set_param(b"type_swa", (name or "").encode()):
        raise ValueError(_str(lib.llama.llama_kvq_last_error()))


def resolve_layer_types(spec: str, n_layer: int, type_k: int, type_v: int) -> tuple[list[int], list[int]]:
    """The K and V type id of each layer under ``spec``; ValueError naming the offending part."""
    lib = libs()
    types_k = lib.ffi.new("int[]", n_layer)
    types_v = lib.ffi.new("int[]", n_layer)
    if not lib.llama.llama_kvq_resolve_layer_types(spec.encode(), n_layer, type_k, type_v, types_k, types_v):
        raise ValueError(_str(lib.llama.llama_kvq_last_error()))
    return list(types_k), list(types_v)


def check_layer_spec(spec: str) -> None:
    """ValueError naming the offending part when ``spec`` does not parse."""
    lib = libs()
    if not lib.llama.llama_kvq_check_layer_types(spec.encode()):
        raise ValueError(_str(lib.llama.llama_kvq_last_error()))
