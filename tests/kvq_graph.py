"""Build and run small ggml graphs of the GGML_OP_KVQ ops through cffi, with numpy arrays in and out, on the
CPU in a context's own memory or on a ggml backend (a GPU, or the RPC backend whose memory the host cannot read).

A ggml tensor's ne[0] is the fastest dimension: a numpy array of shape (a, b, c) becomes ne = (c, b, a).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import numpy as np
import pytest
from cffi import FFI

from pykvq import paths

GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_I64 = 0, 1, 27

_CDEF = """
    struct ggml_init_params { size_t mem_size; void * mem_buffer; bool no_alloc; };
    struct ggml_context;
    struct ggml_tensor;
    struct ggml_cgraph;
    struct ggml_context * ggml_init(struct ggml_init_params params);
    void   ggml_free(struct ggml_context * ctx);
    struct ggml_tensor * ggml_new_tensor_1d(struct ggml_context * ctx, int type, int64_t ne0);
    struct ggml_tensor * ggml_new_tensor_2d(struct ggml_context * ctx, int type, int64_t ne0, int64_t ne1);
    struct ggml_tensor * ggml_new_tensor_3d(struct ggml_context * ctx, int type, int64_t ne0, int64_t ne1, int64_t ne2);
    struct ggml_tensor * ggml_reshape_2d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1);
    struct ggml_tensor * ggml_reshape_4d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1,
                                         int64_t ne2, int64_t ne3);
    struct ggml_tensor * ggml_permute(struct ggml_context * ctx, struct ggml_tensor * a, int axis0, int axis1,
                                      int axis2, int axis3);
    struct ggml_tensor * ggml_flash_attn_ext(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
        struct ggml_tensor * v, struct ggml_tensor * mask, float scale, float max_bias, float logit_softcap);
    struct ggml_tensor * ggml_set_rows(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b,
                                       struct ggml_tensor * c);
    void * ggml_get_data(const struct ggml_tensor * tensor);
    size_t ggml_nbytes(const struct ggml_tensor * tensor);
    struct ggml_cgraph * ggml_new_graph_custom(struct ggml_context * ctx, size_t size, bool grads);
    void   ggml_build_forward_expand(struct ggml_cgraph * cgraph, struct ggml_tensor * tensor);
    int    ggml_graph_compute_with_ctx(struct ggml_context * ctx, struct ggml_cgraph * cgraph, int n_threads);
    int    ggml_graph_n_nodes(struct ggml_cgraph * cgraph);
    struct ggml_tensor * ggml_graph_node(struct ggml_cgraph * cgraph, int i);
    const char * ggml_op_desc(const struct ggml_tensor * t);

    struct ggml_backend;
    struct ggml_backend_buffer;
    struct ggml_backend * ggml_backend_init_by_type(int type, const char * params);
    struct ggml_backend * ggml_backend_rpc_init(const char * endpoint, uint32_t device);
    const char * ggml_backend_name(struct ggml_backend * backend);
    void   ggml_backend_free(struct ggml_backend * backend);
    struct ggml_backend_buffer * ggml_backend_alloc_ctx_tensors(struct ggml_context * ctx,
        struct ggml_backend * backend);
    void   ggml_backend_buffer_free(struct ggml_backend_buffer * buffer);
    void   ggml_backend_tensor_set(struct ggml_tensor * tensor, const void * data, size_t offset, size_t size);
    void   ggml_backend_tensor_get(const struct ggml_tensor * tensor, void * data, size_t offset, size_t size);
    int    ggml_backend_graph_compute(struct ggml_backend * backend, struct ggml_cgraph * cgraph);
    bool   ggml_backend_supports_op(struct ggml_backend * backend, const struct ggml_tensor * op);

    int32_t ggml_kvq_ring_size(int32_t window);
    struct ggml_tensor * ggml_kvq_seal_k(struct ggml_context * ctx, struct ggml_tensor * k_tiles,
        struct ggml_tensor * k_fp16, struct ggml_tensor * k_cur, struct ggml_tensor * k_idxs, int32_t n_sink,
        int32_t n_seq, float clip);
    struct ggml_tensor * ggml_kvq_store_v(struct ggml_context * ctx, struct ggml_tensor * v_rows,
        struct ggml_tensor * v, struct ggml_tensor * idxs, float clip);
    struct ggml_tensor * ggml_kvq_store(struct ggml_context * ctx, struct ggml_tensor * k_tiles,
        struct ggml_tensor * v_rows, struct ggml_tensor * k_fp16, struct ggml_tensor * v_fp16,
        struct ggml_tensor * k_cur, struct ggml_tensor * v_cur, struct ggml_tensor * k_idxs,
        struct ggml_tensor * v_idxs, int32_t n_sink, int32_t n_seq, float clip_k, float clip_v);
    struct ggml_tensor * ggml_kvq_attn(struct ggml_context * ctx, struct ggml_tensor * q,
        struct ggml_tensor * k_tiles, struct ggml_tensor * v_rows, struct ggml_tensor * k_fp16,
        struct ggml_tensor * v_fp16, struct ggml_tensor * k_cur, struct ggml_tensor * v_cur,
        struct ggml_tensor * mask, struct ggml_tensor * k_idxs, int32_t window, int32_t n_sink, float scale,
        int32_t n_seq, bool mask_all_streams);
    struct ggml_tensor * ggml_kvq_attn_latent(struct ggml_context * ctx, struct ggml_tensor * q,
        struct ggml_tensor * k_tiles, struct ggml_tensor * k_fp16, struct ggml_tensor * k_cur,
        struct ggml_tensor * mask, struct ggml_tensor * k_idxs, int64_t head_dim_v, int32_t window, int32_t n_sink,
        float scale, int32_t n_seq, bool mask_all_streams);
    struct ggml_tensor * ggml_view_4d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1,
        int64_t ne2, int64_t ne3, size_t nb1, size_t nb2, size_t nb3, size_t offset);
    void ggml_kvq_attn_set_softcap(struct ggml_tensor * attn, float softcap);
    void ggml_kvq_store_set_v_dither(struct ggml_tensor * store, float spread, int32_t layer, int64_t part_cells,
                                     int64_t period);
    void ggml_kvq_attn_set_sinks(struct ggml_tensor * attn, struct ggml_tensor * sinks);
    void ggml_flash_attn_ext_add_sinks(struct ggml_tensor * a, struct ggml_tensor * sinks);
    struct ggml_tensor * ggml_sum(struct ggml_context * ctx, struct ggml_tensor * a);
    struct ggml_tensor * ggml_mul_mat(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
    struct ggml_tensor * ggml_map_custom1(struct ggml_context * ctx, struct ggml_tensor * a, void * fun, int n_tasks,
                                          void * userdata);
    struct ggml_tensor * ggml_kvq_ring_put(struct ggml_context * ctx, struct ggml_tensor * fp16,
        struct ggml_tensor * cur, struct ggml_tensor * k_idxs, struct ggml_tensor * after, int32_t n_sink,
        int32_t n_seq, int64_t kv_size);
    struct ggml_tensor * ggml_kvq_wide(struct ggml_context * ctx, struct ggml_tensor * quantized,
        struct ggml_tensor * fp16, struct ggml_tensor * cur, struct ggml_tensor * k_idxs, int32_t window,
        int32_t n_sink, int32_t n_seq, int64_t kv_size, int64_t n_kv);
    struct ggml_tensor * ggml_kvq_wide_mask(struct ggml_context * ctx, struct ggml_tensor * mask,
        struct ggml_tensor * k_idxs, int32_t window, int32_t n_sink, int32_t n_seq, int64_t kv_size,
        bool mask_all_streams, int64_t n_kv);
    struct ggml_tensor * ggml_kvq_score_lse(struct ggml_context * ctx, struct ggml_tensor * q,
        struct ggml_tensor * k_wide, struct ggml_tensor * wide_mask, int32_t n_observe, float scale);
    struct ggml_tensor * ggml_kvq_score_add(struct ggml_context * ctx, struct ggml_tensor * scores,
        struct ggml_tensor * q, struct ggml_tensor * k_wide, struct ggml_tensor * wide_mask, struct ggml_tensor * lse,
        struct ggml_tensor * k_idxs, int32_t window, int32_t n_sink, int64_t n_kv, int32_t n_observe, float scale);
"""


GGML_BACKEND_DEVICE_TYPE_GPU = 1


@dataclass(frozen=True)
class _Libs:
    ffi: FFI
    base: object
    cpu: object
    ggml: object  # the backend registry: CPU, RPC and, in a CUDA build, CUDA


@cache
def libs() -> _Libs:
    ffi = FFI()
    ffi.cdef(_CDEF)
    return _Libs(ffi, ffi.dlopen(str(paths.library("ggml-base"))), ffi.dlopen(str(paths.library("ggml-cpu"))),
                 ffi.dlopen(str(paths.library("ggml"))))


def ring_size(window: int) -> int:
    return libs().base.ggml_kvq_ring_size(window)


@dataclass
class Backend:
    """A ggml backend for Context: the GPU of a CUDA build, or an RPC server; close() frees it."""

    handle: object

    @classmethod
    def gpu(cls) -> Backend | None:
        """The first GPU, None when the build has no GPU backend or the machine no GPU."""
        handle = libs().ggml.ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_GPU, libs().ffi.NULL)
        return cls(handle) if handle != libs().ffi.NULL else None

    @classmethod
    def rpc(cls, endpoint: str) -> Backend:
        handle = libs().ggml.ggml_backend_rpc_init(endpoint.encode(), 0)
        if handle == libs().ffi.NULL:
            raise RuntimeError(f"no RPC backend at {endpoint}")
        return cls(handle)

    @property
    def name(self) -> str:
        return libs().ffi.string(libs().base.ggml_backend_name(self.handle)).decode()

    def close(self) -> None:
        libs().base.ggml_backend_free(self.handle)


@dataclass
class Context:
    """A ggml context whose tensors live in its own memory (computed on the CPU) or, with a backend, in buffers of
    that backend: tensors made since the last compute() are allocated there when it runs, arrays given to them
    written then. Freed with close()."""

    mem_size: int = 64 << 20
    backend: Backend | None = None
    ctx: object = field(init=False)
    _buffers: list = field(init=False, default_factory=list)
    _pending: list = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        lib = libs()
        self.ctx = lib.base.ggml_init({"mem_size": self.mem_size, "mem_buffer": lib.ffi.NULL,
                                       "no_alloc": self.backend is not None})

    def close(self) -> None:
        for buffer in self._buffers:
            libs().base.ggml_backend_buffer_free(buffer)
        libs().base.ggml_free(self.ctx)

    def new(self, type_id: int, *ne: int):
        base = libs().base
        return {1: base.ggml_new_tensor_1d, 2: base.ggml_new_tensor_2d, 3: base.ggml_new_tensor_3d}[len(ne)](
            self.ctx, type_id, *ne)

    def tensor(self, array: np.ndarray):
        """A new tensor holding a copy of a float32 / float16 / int64 array."""
        type_id = {np.float32: GGML_TYPE_F32, np.float16: GGML_TYPE_F16, np.int64: GGML_TYPE_I64}[array.dtype.type]
        t = self.new(type_id, *reversed(array.shape))
        if self.backend is None:
            write(t, array)
        else:
            self.pending_write(t, np.ascontiguousarray(array).tobytes())
        return t

    def pending_write(self, t, data: bytes) -> None:
        """Bytes for a tensor of a backend context, written when the next compute() allocates it."""
        self._pending.append((t, data))

    def compute(self, *outputs, n_threads: int = 2) -> None:
        base, cpu = libs().base, libs().cpu
        graph = base.ggml_new_graph_custom(self.ctx, 256, False)
        for out in outputs:
            base.ggml_build_forward_expand(graph, out)
        if self.backend is None:
            assert cpu.ggml_graph_compute_with_ctx(self.ctx, graph, n_threads) == 0
            return
        self._skip_unless_supported(graph)
        buffer = base.ggml_backend_alloc_ctx_tensors(self.ctx, self.backend.handle)
        if buffer != libs().ffi.NULL:
            self._buffers.append(buffer)
        for t, data in self._pending:
            assert len(data) == base.ggml_nbytes(t)
            base.ggml_backend_tensor_set(t, data, 0, len(data))
        self._pending.clear()
        assert base.ggml_backend_graph_compute(self.backend.handle, graph) == 0

    def _skip_unless_supported(self, graph) -> None:
        """A graph runs on one backend here, with no scheduler to send an op the backend lacks to the CPU (as
        llama.cpp's does, e.g. upstream's CUDA flash attention for a head size it has no kernel for): such a case
        judges nothing on this backend."""
        lib = libs()
        for i in range(lib.base.ggml_graph_n_nodes(graph)):
            node = lib.base.ggml_graph_node(graph, i)
            if not lib.base.ggml_backend_supports_op(self.backend.handle, node):
                op = lib.ffi.string(lib.base.ggml_op_desc(node)).decode()
                pytest.skip(f"{self.backend.name} has no kernel for {op} at these shapes (llama.cpp's scheduler "
                            "would run it on the CPU)")

    def read(self, t, dtype, shape) -> np.ndarray:
        if self.backend is None:
            return read(t, dtype, shape)
        base = libs().base
        out = bytearray(base.ggml_nbytes(t))
        base.ggml_backend_tensor_get(t, libs().ffi.from_buffer(out), 0, len(out))
        return np.frombuffer(bytes(out), dtype=dtype).reshape(shape).copy()


def _buffer(t) -> memoryview:
    lib = libs()
    return lib.ffi.buffer(lib.base.ggml_get_data(t), lib.base.ggml_nbytes(t))


def write(t, array: np.ndarray) -> None:
    data = np.ascontiguousarray(array).tobytes()
    buf = _buffer(t)
    assert len(buf) == len(data), (len(buf), len(data))
    buf[:] = data


def read(t, dtype, shape) -> np.ndarray:
    return np.frombuffer(bytes(_buffer(t)), dtype=dtype).reshape(shape).copy()


def read_bytes(t) -> np.ndarray:
    return np.frombuffer(bytes(_buffer(t)), dtype=np.uint8).copy()
