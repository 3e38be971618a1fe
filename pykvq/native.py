"""cffi (ABI mode) bindings to the built libllama, libggml and pykvq's C API extension."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from cffi import FFI

from pykvq import paths

# enum ggml_type is passed as int: same size and calling convention on every platform we build for
_CDEF = """
    const char * llama_kvq_version(void);
    size_t       llama_kvq_n_cache_types(void);
    int          llama_kvq_cache_type(size_t i);
    const char * llama_print_system_info(void);

    const char * ggml_type_name(int type);
    int64_t      ggml_blck_size(int type);
    size_t       ggml_type_size(int type);

    typedef struct ggml_backend_reg * ggml_backend_reg_t;
    size_t             ggml_backend_reg_count(void);
    ggml_backend_reg_t ggml_backend_reg_get(size_t index);
    const char *       ggml_backend_reg_name(ggml_backend_reg_t reg);
"""



@dataclass(frozen=True)
class Libraries:
    ffi: FFI
    llama: object
    ggml: object
    ggml_base: object


@cache
def libs() -> Libraries:
    ffi = FFI()
    ffi.cdef(_CDEF)
    # ggml-base and ggml first: libllama finds them through its RPATH, but the handles are ours
    ggml_base = ffi.dlopen(str(paths.library("ggml-base")))
    ggml = ffi.dlopen(str(paths.library("ggml")))
    llama = ffi.dlopen(str(paths.library("llama")))
    return Libraries(ffi, llama, ggml, ggml_base)


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
