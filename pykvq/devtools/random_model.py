"""Random-weight GGUF files of a given shape and family (Llama, Gemma 2/3/4 and gpt-oss with their
sliding-window layers, Gemma 4's layers that read an earlier layer's KV cache), for speed and memory benchmarks
and for tests of the KV cache on each family's graph.

The weights are random Q4_0 (or Q4_1) blocks (small scales, so activations stay finite), the tokenizer a placeholder
SentencePiece vocabulary of the right size: the model computes exactly what a real model of that shape
computes, which is all a KV-cache speed or memory figure needs.

    python -m pykvq.devtools.random_model llama3-8b /tmp/llama3-8b-random.gguf
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pykvq.bindings import gguf_py

log = logging.getLogger("pykvq.random_model")

QK4 = 32
# llama.cpp's Gemma 3n hyperparameters that its GGUFs leave out
GEMMA3N_ALTUP = 4
GEMMA3N_PER_LAYER = 256
GEMMA3N_LAUREL_RANK = 64
Q4_CODE_BYTES = 16  # after an fp16 scale (Q4_0), or an fp16 scale and minimum (Q4_1)
T5_BUCKETS = 32
MAMBA_STATE, MAMBA_CONV = 16, 4
# Qwen 3.5's gated delta nets at small size: heads of 32 channels, 2 key heads, 4 value heads, convolution 4
DELTA_HEAD, DELTA_K_HEADS, DELTA_V_HEADS, DELTA_CONV = 32, 2, 4, 4
KDA_HEAD, KDA_CONV = 32, 4  # Kimi Linear's delta attention: head size per query head, convolution taps
BAILING_GATE_LOWER_BOUND = -5.0  # Ling 3's decay gate: sigmoid(...) scaled into (-5, 0)
QWEN35_ATTENTION_INTERVAL = 4  # llama.cpp's default: every 4th layer attends, the others are delta nets


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    n_ctx_train: int
    rope_freq_base: float
    # "llama"; "deci": llama with per-layer head counts; "gemma3": every 6th layer global, the others
    # sliding-window (n_swa), Q/K norms; "gemma2": every other layer sliding-window, attention logit soft-capping;
    # "gpt-oss": every other layer sliding-window, learned attention sinks, n_expert experts of n_ff; "gemma4":
    # every swa_pattern-th layer global with head size head_dim, the others sliding-window with head_dim_swa, Q/K
    # norms, a KQ scale of 1, and the last n_kv_shared layers reading the KV cache of the last layer of their kind
    # before them; "gemma3n": every 5th layer global, AltUp, Laurel and per-layer inputs, layers from the 20th on
    # reading earlier caches as gemma4's do (llama.cpp's fixed count); "lfm2": a hybrid, short gated convolutions
    # (a recurrent state) in the layers of 0 KV heads (n_head_kv_layers), attention with Q/K norms in the others;
    # "deepseek2" and "mistral4": multi-head latent attention, one compressed KV row of kv_lora_rank + the RoPE part per
    # token (head_dim: the query/key head size, of which rope_dim rotate; V heads of head_dim - rope_dim), dense FFNs;
    # "kimi-linear": a hybrid, Kimi delta attention (a recurrent state) in the layers of 0 KV heads
    # (n_head_kv_layers), deepseek2's multi-head latent attention (without RoPE) in the others, dense FFNs;
    # "bailingmoe3": Ling 3's hybrid, kimi-linear's layout with its own delta attention (full-width decay and output
    # gate projections) and a sigmoid gate per head on the latent attention's output, dense FFNs;
    # "llama4": every 4th layer global without RoPE, the others chunked attention (8192-token chunks), Q/K L2 norms,
    # n_expert experts and a shared one in every moe_layer_step-th layer; "t5": an encoder and a decoder of n_layer
    # each, relative position biases in their attention; "mamba": no attention at all, Mamba's selective
    # state-space blocks (inner size 2 n_embd, state 16, convolution 4); "qwen35": a hybrid, gated delta nets (a
    # recurrent state) in 3 layers of 4, gated attention in the others, Q/K norms, interleaved M-RoPE on rope_dim
    # channels of each head
    arch: str = "llama"
    head_dim: int | None = None  # None: n_embd / n_head
    n_swa: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    swa_pattern: int = 0  # every swa_pattern-th layer global; 0: the family's own
    n_head_kv_layers: tuple[int, ...] = ()  # KV heads per layer where they differ (deci)
    attn_softcap: float = 50.0  # gemma2's attention logit soft-cap (Gemma 2's own value)
    attn_sink: float | None = None  # gpt-oss's learned sink logit in every head; None: small random ones
    head_dim_swa: int | None = None  # gemma4's sliding-window layers' head size; None: head_dim
    n_kv_shared: int = 0  # gemma4: the last layers that keep no KV of their own
    shortconv_l_cache: int = 3  # lfm2's convolution width
    kv_lora_rank: int = 0  # deepseek2's compressed KV
    moe_layer_step: int = 1  # every moe_layer_step-th layer has the experts (llama4), the others a dense FFN
    rope_dim: int = 0  # deepseek2's and qwen35's rotated part of each head; 0: the whole head
    attn_temp_scale: float = 0.0  # Mistral's attention temperature: Q grows with log(position / attn_temp_length)
    attn_temp_length: int = 0

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention: deepseek2's graph (its own models and mistral4's), kimi-linear's,
        bailingmoe3's."""
        return self.kv_lora_rank > 0

    def n_head_kv_of(self, il: int) -> int:
        return self.n_head_kv_layers[il] if self.n_head_kv_layers else self.n_head_kv

    @property
    def n_embd_head(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    @property
    def is_gemma(self) -> bool:
        return self.arch in ("gemma2", "gemma3", "gemma3n", "gemma4")

    def is_swa(self, il: int) -> bool:
        """gemma4's layer kinds (the other families' are the model loader's own rule)."""
        return (il + 1) % self.swa_pattern != 0

    def head_dim_of(self, il: int) -> int:
        if self.arch == "gemma4" and self.is_swa(il):
            return self.head_dim_swa or self.n_embd_head
        return self.n_embd_head

    def has_kv(self, il: int) -> bool:
        return il < self.n_layer - self.n_kv_shared

    def is_moe(self, il: int) -> bool:
        return self.n_expert > 0 and (il + 1) % self.moe_layer_step == 0

    def is_recurrent(self, il: int) -> bool:
        if self.arch == "qwen35":
            return (il + 1) % QWEN35_ATTENTION_INTERVAL != 0
        return self.arch in ("lfm2", "kimi-linear", "bailingmoe3") and self.n_head_kv_of(il) == 0


SHAPES = {
    "llama3-8b": Shape(32, 4096, 14336, 32, 8, 128256, 1048576, 500000.0),
    "tiny": Shape(2, 256, 512, 4, 2, 1024, 65536, 10000.0),
    # small models for GPU-vs-CPU tests, head sizes 64 and 128 with GQA
    "small-h64": Shape(4, 512, 1024, 8, 2, 2048, 65536, 10000.0),
    "small-h128": Shape(4, 1024, 2048, 8, 2, 2048, 65536, 500000.0),
    # Gemma-3's shape at small size: head size 256, 5 sliding-window layers to 1 global, a short window
    # a different KV head count in each layer (GQA 2, 4 and 1): DeciLM's llama variant (Nemotron)
    "deci-kv-heads": Shape(3, 256, 512, 4, 2, 1024, 65536, 10000.0, arch="deci", n_head_kv_layers=(2, 1, 4)),
    "gemma3-small": Shape(6, 512, 1024, 4, 2, 2048, 32768, 1000000.0, arch="gemma3", head_dim=256, n_swa=96),
    "gemma3-1b": Shape(26, 1152, 6912, 4, 1, 262144, 32768, 1000000.0, arch="gemma3", head_dim=256, n_swa=512),
    "gemma2-small": Shape(2, 512, 1024, 4, 2, 2048, 8192, 10000.0, arch="gemma2", head_dim=128, n_swa=64),
    # Gemma 4's shape at small size (E2B's kinds): 3 sliding-window layers (head size 64) to 1 global (128), the
    # last 4 layers reading layer 2's (sliding-window) or layer 3's (global) cache
    "gemma4-small": Shape(8, 256, 512, 4, 2, 2048, 32768, 1000000.0, arch="gemma4", head_dim=128, head_dim_swa=64,
                          n_swa=64, swa_pattern=4, n_kv_shared=4),
    # Gemma 4 E2B's attention (35 layers, 4 sliding-window of head size 256 to 1 global of 512, one KV head, a
    # 512-token window, the last 20 layers reading earlier caches) with a small FFN and vocabulary, which the KV
    # cache does not see: for memory figures
    "gemma4-e2b-attention": Shape(35, 1536, 256, 8, 1, 2048, 131072, 1000000.0, arch="gemma4", head_dim=512,
                                  head_dim_swa=256, n_swa=512, swa_pattern=5, n_kv_shared=20),
    # Gemma 3n's shape at small size: 25 layers (llama.cpp's Gemma 3n keeps KV in its first 20), 4 sliding-window
    # to 1 global, layers 20-23 reading layer 18's cache and 24 reading layer 19's
    "gemma3n-small": Shape(25, 256, 512, 4, 2, 2048, 32768, 1000000.0, arch="gemma3n", head_dim=128, n_swa=64),
    # LFM2's hybrid at small size: convolution, attention, convolution, attention (LFM2-350M: 10 to 6 of 16)
    "lfm2-small": Shape(4, 256, 512, 4, 2, 2048, 32768, 1000000.0, arch="lfm2", n_head_kv_layers=(0, 2, 0, 2)),
    # DeepSeek-V2's attention at small size: a 128-wide latent and 32 RoPE channels (its cache rows hold 160 values)
    "deepseek2-mla-small": Shape(2, 256, 512, 4, 1, 2048, 8192, 10000.0, arch="deepseek2", head_dim=96,
                                 kv_lora_rank=128, rope_dim=32),
    # DeepSeek-V2-Lite's attention (27 layers, 16 heads of 192, a 512-wide latent and 64 RoPE channels) with a small
    # dense FFN and vocabulary, which the KV cache does not see: for memory and speed figures
    "deepseek2-lite-attention": Shape(27, 2048, 512, 16, 1, 2048, 163840, 10000.0, arch="deepseek2", head_dim=192,
                                      kv_lora_rank=512, rope_dim=64),
    # Mistral 4's attention at small size: deepseek2's graph, a 256-wide latent and 64 RoPE channels, and Mistral's
    # attention temperature (Q scaled by 1 + 0.1 log(1 + floor(position / 64)) here)
    "mistral4-mla-small": Shape(2, 256, 512, 4, 1, 2048, 32768, 10000.0, arch="mistral4", head_dim=128,
                                kv_lora_rank=256, rope_dim=64, attn_temp_scale=0.1, attn_temp_length=64),
    # Kimi Linear's hybrid at small size: delta attention in layers 0-2, latent attention (a 128-wide latent and 32
    # unrotated channels) in layer 3, as Kimi-Linear-48B-A3B's 3 to 1
    "kimi-linear-small": Shape(4, 256, 512, 4, 1, 2048, 32768, 10000.0, arch="kimi-linear", head_dim=96,
                               kv_lora_rank=128, rope_dim=32, n_head_kv_layers=(0, 0, 0, 1)),
    # Ling 3's hybrid (bailingmoe3) at small size: delta attention in layers 0-2, gated latent attention in layer 3
    "bailingmoe3-small": Shape(4, 256, 512, 4, 1, 2048, 32768, 10000.0, arch="bailingmoe3", head_dim=96,
                               kv_lora_rank=128, rope_dim=32, n_head_kv_layers=(0, 0, 0, 1)),
    "qwen2vl-small": Shape(2, 256, 512, 4, 2, 2048, 32768, 1000000.0, arch="qwen2vl"),  # M-RoPE: 4 positions a token
    # Qwen 3.5's hybrid at small size: delta nets in layers 0-2, gated attention (head size 64, a quarter rotated)
    "qwen35-small": Shape(4, 256, 512, 4, 2, 2048, 262144, 10000000.0, arch="qwen35", head_dim=64, rope_dim=16),
    # Llama 4's attention at small size: 3 layers of chunked attention (llama.cpp's fixed 8192-token chunks) to 1
    # global layer without RoPE, Q and K L2-normed; experts with a shared one in every other layer
    "llama4-small": Shape(4, 256, 512, 4, 2, 2048, 32768, 500000.0, arch="llama4", n_expert=2, n_expert_used=1,
                          moe_layer_step=2),
    # T5's encoder-decoder at small size (flan-t5-small's 32 relative position buckets)
    "t5-small": Shape(2, 256, 512, 4, 4, 2048, 512, 10000.0, arch="t5"),
    "mamba-small": Shape(2, 256, 0, 1, 0, 2048, 1048576, 10000.0, arch="mamba"),
    "gpt-oss-small": Shape(2, 256, 128, 4, 2, 2048, 8192, 150000.0, arch="gpt-oss", head_dim=64, n_swa=64,
                           n_expert=4, n_expert_used=2),
}


def random_q4(rows: int, cols: int, rng: np.random.Generator, with_min: bool = False) -> np.ndarray:
    """[rows, cols] of Q4_0, or with ``with_min`` Q4_1, as raw bytes: random codes, scales around 1/sqrt(cols); Q4_1's
    minimum of -8 scales gives it Q4_0's values."""
    if cols % QK4:
        raise ValueError(f"Q4 rows need a multiple of {QK4} values, got {cols}")
    header = 4 if with_min else 2
    blocks = rng.integers(0, 256, size=(rows, cols // QK4, header + Q4_CODE_BYTES), dtype=np.uint8)
    scale = np.float16(2.0 / np.sqrt(cols))
    blocks[:, :, 0:2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    if with_min:
        blocks[:, :, 2:4] = np.frombuffer(np.float16(-8 * scale).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def mrope_sections(head_dim: int) -> list[int]:
    """Qwen2-VL's split of the rotary pairs (16, 24, 24, 0 of a head of 128), for any head size."""
    pairs = head_dim // 2
    return [pairs // 4, (pairs - pairs // 4) // 2, pairs - pairs // 4 - (pairs - pairs // 4) // 2, 0]


def mamba_dt_rank(shape: Shape) -> int:
    return -(-shape.n_embd // 16)  # Mamba's ceil(d_model / 16)


def write(shape: Shape, path: Path, seed: int = 0, byte_tokens: bool = True, q4_1: bool = False) -> None:
    """A random model of ``shape``; ``byte_tokens=False`` leaves SentencePiece's byte fallbacks out, a hostile
    vocabulary for tests; ``q4_1``: Q4_1 weights rather than Q4_0, which the CPU backend runs through repacked
    kernels on the host only (a device behind RPC then computes other roundings)."""
    gguf = gguf_py.gguf()
    rng = np.random.default_rng(seed)
    head_dim = shape.n_embd_head
    writer = gguf.GGUFWriter(path, arch=shape.arch)
    writer.add_name(f"random {path.stem}")
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    if shape.n_head_kv_layers:
        writer.add_array(gguf.Keys.Attention.HEAD_COUNT_KV.format(arch=shape.arch), list(shape.n_head_kv_layers))
    else:
        writer.add_head_count_kv(shape.n_head_kv)
    if shape.is_mla:
        # the cache's rows: the latent and the RoPE part (K), the latent (V); the heads' own sizes are the _mla keys
        writer.add_rope_dimension_count(shape.rope_dim)
        writer.add_key_length(shape.kv_lora_rank + shape.rope_dim)
        writer.add_value_length(shape.kv_lora_rank)
        writer.add_key_length_mla(head_dim)
        writer.add_value_length_mla(head_dim - shape.rope_dim)
        writer.add_q_lora_rank(0)
        writer.add_kv_lora_rank(shape.kv_lora_rank)
        writer.add_leading_dense_block_count(shape.n_layer)
        writer.add_expert_feed_forward_length(shape.n_ff)
        writer.add_expert_shared_count(0)
    else:
        writer.add_rope_dimension_count(shape.rope_dim or head_dim)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(shape.rope_freq_base)
    if shape.n_swa:
        writer.add_sliding_window(shape.n_swa)
    if shape.arch == "gemma4":
        writer.add_array(gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=shape.arch),
                         [shape.is_swa(il) for il in range(shape.n_layer)])
        head_dim_swa = shape.head_dim_swa or head_dim
        writer.add_uint32(f"{shape.arch}.attention.key_length_swa", head_dim_swa)
        writer.add_uint32(f"{shape.arch}.attention.value_length_swa", head_dim_swa)
        writer.add_uint32(f"{shape.arch}.rope.dimension_count_swa", head_dim_swa)
        writer.add_uint32(f"{shape.arch}.attention.shared_kv_layers", shape.n_kv_shared)
        writer.add_uint32(f"{shape.arch}.embedding_length_per_layer_input", 0)
    elif shape.swa_pattern:
        writer.add_uint32(gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=shape.arch), shape.swa_pattern)
    if shape.arch in ("qwen2vl", "qwen35"):
        # M-RoPE's rotary pairs of each head split among time, height, width (and an unused fourth), as Qwen2-VL's
        writer.add_array(f"{shape.arch}.rope.dimension_sections", mrope_sections(shape.rope_dim or head_dim))
    if shape.arch == "qwen35":
        writer.add_ssm_conv_kernel(DELTA_CONV)
        writer.add_ssm_inner_size(DELTA_HEAD * DELTA_V_HEADS)
        writer.add_ssm_state_size(DELTA_HEAD)
        writer.add_ssm_time_step_rank(DELTA_V_HEADS)
        writer.add_ssm_group_count(DELTA_K_HEADS)
    if shape.arch in ("kimi-linear", "bailingmoe3"):
        writer.add_ssm_conv_kernel(KDA_CONV)
        writer.add_uint32(gguf.Keys.KDA.HEAD_DIM.format(arch=shape.arch), KDA_HEAD)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if shape.arch == "bailingmoe3":
        writer.add_float32(f"{shape.arch}.kda.gate_lower_bound", BAILING_GATE_LOWER_BOUND)
    if shape.attn_temp_scale:
        writer.add_float32(gguf.Keys.Attention.TEMPERATURE_SCALE.format(arch=shape.arch), shape.attn_temp_scale)
        writer.add_uint32(gguf.Keys.Attention.TEMPERATURE_LENGTH.format(arch=shape.arch), shape.attn_temp_length)
    if shape.arch == "gemma2":
        writer.add_attn_logit_softcapping(shape.attn_softcap)
    if shape.arch == "lfm2":
        writer.add_uint32(f"{shape.arch}.shortconv.l_cache", shape.shortconv_l_cache)
    if shape.arch == "mamba":
        writer.add_ssm_conv_kernel(MAMBA_CONV)
        writer.add_ssm_inner_size(2 * shape.n_embd)
        writer.add_ssm_state_size(MAMBA_STATE)
        writer.add_ssm_time_step_rank(mamba_dt_rank(shape))
    if shape.arch == "t5":
        writer.add_relative_attn_buckets_count(T5_BUCKETS)
        writer.add_decoder_start_token_id(0)
    if shape.n_expert:
        writer.add_expert_count(shape.n_expert)
        writer.add_expert_used_count(shape.n_expert_used)
        writer.add_expert_feed_forward_length(shape.n_ff)
    if shape.moe_layer_step > 1:
        writer.add_uint32(gguf.Keys.LLM.INTERLEAVE_MOE_LAYER_STEP.format(arch=shape.arch), shape.moe_layer_step)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1 if q4_1 else gguf.LlamaFileType.MOSTLY_Q4_0)
    # SentencePiece needs its control tokens and byte fallbacks: without them llama.cpp's tokenizer throws
    special = [("<unk>", gguf.TokenType.UNKNOWN), ("<s>", gguf.TokenType.CONTROL), ("</s>", gguf.TokenType.CONTROL)]
    special += [(f"<0x{b:02X}>", gguf.TokenType.BYTE) for b in range(256 if byte_tokens else 0)]
    tokens = special + [(f"<t{i}>", gguf.TokenType.NORMAL) for i in range(shape.n_vocab - len(special))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list([text for text, _ in tokens])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([kind for _, kind in tokens])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def matrix(name: str, rows: int, cols: int) -> None:
        raw_dtype = gguf.GGMLQuantizationType.Q4_1 if q4_1 else gguf.GGMLQuantizationType.Q4_0
        writer.add_tensor(name, random_q4(rows, cols, rng, q4_1), raw_dtype=raw_dtype)

    def norm(name: str, size: int = shape.n_embd) -> None:
        writer.add_tensor(name, np.ones(size, dtype=np.float32))

    def small(name: str, *dims: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(dims) * 0.05).astype(np.float32))

    def experts(il: int) -> None:
        """The MoE block: a router and expert matrices (f32: they are 3-D), biased in gpt-oss, and in Llama 4 after
        the FFN norm with a shared expert beside them."""
        biased = shape.arch == "gpt-oss"
        small(f"blk.{il}.ffn_gate_inp.weight", shape.n_expert, shape.n_embd)
        if biased:
            small(f"blk.{il}.ffn_gate_inp.bias", shape.n_expert)
        for part, rows, cols in (("gate", shape.n_ff, shape.n_embd), ("up", shape.n_ff, shape.n_embd),
                                 ("down", shape.n_embd, shape.n_ff)):
            small(f"blk.{il}.ffn_{part}_exps.weight", shape.n_expert, rows, cols)
            if biased:
                small(f"blk.{il}.ffn_{part}_exps.bias", shape.n_expert, rows)
            if shape.arch == "llama4":
                matrix(f"blk.{il}.ffn_{part}_shexp.weight", rows, cols)
        if shape.arch == "llama4":
            norm(f"blk.{il}.ffn_norm.weight")

    def gemma3n_model_tensors() -> None:
        """AltUp's projections of the residual stream and the per-layer inputs, with llama.cpp's defaults: 4 AltUp
        streams, 256 per-layer input channels."""
        n_altup, n_embd_altup = GEMMA3N_ALTUP, GEMMA3N_PER_LAYER
        small("altup_proj.weight", n_altup - 1, shape.n_embd, shape.n_embd)
        small("altup_unembd_proj.weight", n_altup - 1, shape.n_embd, shape.n_embd)
        matrix("per_layer_token_embd.weight", shape.n_vocab, n_embd_altup * shape.n_layer)
        matrix("per_layer_model_proj.weight", n_embd_altup * shape.n_layer, shape.n_embd)
        norm("per_layer_proj_norm.weight", n_embd_altup)

    def gemma3n_layer_tensors(il: int) -> None:
        n_altup, n_embd_altup = GEMMA3N_ALTUP, GEMMA3N_PER_LAYER
        matrix(f"blk.{il}.inp_gate.weight", n_embd_altup, shape.n_embd)
        matrix(f"blk.{il}.proj.weight", shape.n_embd, n_embd_altup)
        norm(f"blk.{il}.post_norm.weight")
        small(f"blk.{il}.altup_correct_coef.weight", n_altup, n_altup)
        norm(f"blk.{il}.altup_correct_scale.weight")
        small(f"blk.{il}.altup_predict_coef.weight", n_altup * n_altup, n_altup)
        matrix(f"blk.{il}.altup_router.weight", n_altup, shape.n_embd)
        norm(f"blk.{il}.altup_router_norm.weight")
        matrix(f"blk.{il}.laurel_l.weight", GEMMA3N_LAUREL_RANK, shape.n_embd)
        matrix(f"blk.{il}.laurel_r.weight", shape.n_embd, GEMMA3N_LAUREL_RANK)
        norm(f"blk.{il}.laurel_post_norm.weight")

    def shortconv(il: int) -> None:
        """LFM2's gated convolution: B, C and x from one projection, a depthwise kernel of l_cache taps."""
        small(f"blk.{il}.shortconv.conv.weight", shape.n_embd, shape.shortconv_l_cache)
        matrix(f"blk.{il}.shortconv.in_proj.weight", 3 * shape.n_embd, shape.n_embd)
        matrix(f"blk.{il}.shortconv.out_proj.weight", shape.n_embd, shape.n_embd)

    def attention(il: int) -> None:
        dim = shape.head_dim_of(il)
        n_embd_q = dim * shape.n_head
        # Qwen 3.5's query projection carries the output gate beside the queries
        matrix(f"blk.{il}.attn_q.weight", n_embd_q * (2 if shape.arch == "qwen35" else 1), shape.n_embd)
        n_embd_kv = dim * shape.n_head_kv_of(il)
        if shape.has_kv(il):
            matrix(f"blk.{il}.attn_k.weight", n_embd_kv, shape.n_embd)
            matrix(f"blk.{il}.attn_v.weight", n_embd_kv, shape.n_embd)
        matrix(f"blk.{il}.attn_output.weight", shape.n_embd, n_embd_q)

    def mamba_block(il: int) -> None:
        """Mamba's selective state-space block: input projection, causal convolution, the data-dependent step
        size and B, C, the state matrix A (negative: a decaying state) and the skip D."""
        d_inner, dt_rank = 2 * shape.n_embd, mamba_dt_rank(shape)
        matrix(f"blk.{il}.ssm_in.weight", 2 * d_inner, shape.n_embd)
        small(f"blk.{il}.ssm_conv1d.weight", d_inner, MAMBA_CONV)
        small(f"blk.{il}.ssm_conv1d.bias", d_inner)
        matrix(f"blk.{il}.ssm_x.weight", dt_rank + 2 * MAMBA_STATE, d_inner)
        small(f"blk.{il}.ssm_dt.weight", d_inner, dt_rank)
        small(f"blk.{il}.ssm_dt.bias", d_inner)
        writer.add_tensor(f"blk.{il}.ssm_a", -np.ones((d_inner, MAMBA_STATE), np.float32))
        writer.add_tensor(f"blk.{il}.ssm_d", np.ones(d_inner, np.float32))
        matrix(f"blk.{il}.ssm_out.weight", shape.n_embd, d_inner)

    def delta_net(il: int) -> None:
        """Qwen 3.5's gated delta net: Q, K, V from one projection through a causal convolution, its output gate,
        the per-head decay (A, negative: a decaying state; dt's bias) and write strength (beta), a norm per head."""
        key_dim, value_dim = DELTA_HEAD * DELTA_K_HEADS, DELTA_HEAD * DELTA_V_HEADS
        matrix(f"blk.{il}.attn_qkv.weight", 2 * key_dim + value_dim, shape.n_embd)
        matrix(f"blk.{il}.attn_gate.weight", value_dim, shape.n_embd)
        small(f"blk.{il}.ssm_conv1d.weight", 2 * key_dim + value_dim, DELTA_CONV)
        small(f"blk.{il}.ssm_dt.bias", DELTA_V_HEADS)
        writer.add_tensor(f"blk.{il}.ssm_a", -np.ones(DELTA_V_HEADS, np.float32))
        matrix(f"blk.{il}.ssm_beta.weight", DELTA_V_HEADS, shape.n_embd)
        matrix(f"blk.{il}.ssm_alpha.weight", DELTA_V_HEADS, shape.n_embd)
        norm(f"blk.{il}.ssm_norm.weight", DELTA_HEAD)
        matrix(f"blk.{il}.ssm_out.weight", shape.n_embd, value_dim)

    def kimi_delta_attention(il: int) -> None:
        """Kimi Linear's delta attention (and Ling 3's): Q, K, V projections each through a causal convolution, the
        decay's and the output gate's projections (low-rank in Kimi's, full-width in Ling 3's), beta, A (negative: a
        decaying state), the step bias, the output norm."""
        d_inner = KDA_HEAD * shape.n_head
        for part in "qkv":
            small(f"blk.{il}.ssm_conv1d_{part}.weight", d_inner, 1, KDA_CONV)
            matrix(f"blk.{il}.attn_{part}.weight", d_inner, shape.n_embd)

        def projection(gate: str) -> None:
            if shape.arch == "bailingmoe3":
                matrix(f"blk.{il}.ssm_{gate}_a.weight", d_inner, shape.n_embd)
            else:
                matrix(f"blk.{il}.ssm_{gate}_a.weight", KDA_HEAD, shape.n_embd)
                matrix(f"blk.{il}.ssm_{gate}_b.weight", d_inner, KDA_HEAD)

        projection("f")
        matrix(f"blk.{il}.ssm_beta.weight", shape.n_head, shape.n_embd)
        writer.add_tensor(f"blk.{il}.ssm_a", -np.ones((shape.n_head, 1), np.float32))
        small(f"blk.{il}.ssm_dt.bias", d_inner)
        projection("g")
        norm(f"blk.{il}.ssm_norm.weight", KDA_HEAD)
        matrix(f"blk.{il}.attn_output.weight", shape.n_embd, d_inner)

    def latent_attention(il: int) -> None:
        """DeepSeek-V2's MLA without a query LoRA: the latent's down-projection and norm, and per head its K and V
        up-projections (3-D, f32)."""
        v_dim = head_dim - shape.rope_dim
        matrix(f"blk.{il}.attn_q.weight", shape.n_head * head_dim, shape.n_embd)
        matrix(f"blk.{il}.attn_kv_a_mqa.weight", shape.kv_lora_rank + shape.rope_dim, shape.n_embd)
        norm(f"blk.{il}.attn_kv_a_norm.weight", shape.kv_lora_rank)
        small(f"blk.{il}.attn_k_b.weight", shape.n_head, shape.kv_lora_rank, v_dim)
        small(f"blk.{il}.attn_v_b.weight", shape.n_head, v_dim, shape.kv_lora_rank)
        matrix(f"blk.{il}.attn_output.weight", shape.n_embd, shape.n_head * v_dim)
        if shape.arch == "bailingmoe3":
            matrix(f"blk.{il}.attn_gate.weight", shape.n_head, shape.n_embd)

    def t5_tensors() -> None:
        """T5's encoder and decoder blocks: self-attention with relative position biases, the decoder's cross
        attention, gated FFNs, and each stack's final norm."""
        n_embd_kv = shape.n_embd_head * shape.n_head_kv
        for stack in ("enc", "dec"):
            for il in range(shape.n_layer):
                blk = f"{stack}.blk.{il}"
                for part in ("attn", "cross_attn") if stack == "dec" else ("attn",):
                    norm(f"{blk}.{part}_norm.weight")
                    for proj in "qkv":
                        matrix(f"{blk}.{part}_{proj}.weight", n_embd_kv, shape.n_embd)
                    matrix(f"{blk}.{part}_o.weight", shape.n_embd, n_embd_kv)
                small(f"{blk}.attn_rel_b.weight", T5_BUCKETS, shape.n_head)
                norm(f"{blk}.ffn_norm.weight")
                matrix(f"{blk}.ffn_gate.weight", shape.n_ff, shape.n_embd)
                matrix(f"{blk}.ffn_up.weight", shape.n_ff, shape.n_embd)
                matrix(f"{blk}.ffn_down.weight", shape.n_embd, shape.n_ff)
            norm(f"{stack}.output_norm.weight")
        matrix("output.weight", shape.n_vocab, shape.n_embd)

    def decoder_tensors() -> None:
        """A decoder-only model's tensors after the token embedding."""
        if shape.arch == "gemma3n":
            gemma3n_model_tensors()
        if shape.arch == "gemma4":
            norm("rope_freqs.weight", head_dim // 2)
        for il in range(shape.n_layer):
            dim = shape.head_dim_of(il)
            norm(f"blk.{il}.attn_norm.weight")
            if shape.arch == "mamba":
                mamba_block(il)
                continue
            if shape.is_recurrent(il):
                recurrent = {"qwen35": delta_net, "kimi-linear": kimi_delta_attention,
                             "bailingmoe3": kimi_delta_attention}
                recurrent.get(shape.arch, shortconv)(il)
            elif shape.is_mla:
                latent_attention(il)
            else:
                attention(il)
            if shape.is_moe(il):
                experts(il)
            else:
                # Qwen 3.5 norms the FFN's input with the post-attention norm
                norm(f"blk.{il}.post_attention_norm.weight" if shape.arch == "qwen35" else f"blk.{il}.ffn_norm.weight")
                matrix(f"blk.{il}.ffn_gate.weight", shape.n_ff, shape.n_embd)
                matrix(f"blk.{il}.ffn_up.weight", shape.n_ff, shape.n_embd)
                matrix(f"blk.{il}.ffn_down.weight", shape.n_embd, shape.n_ff)
            if shape.arch == "gpt-oss":
                norm(f"blk.{il}.post_attention_norm.weight")
                small(f"blk.{il}.attn_output.bias", shape.n_embd)
                if shape.attn_sink is None:
                    small(f"blk.{il}.attn_sinks.weight", shape.n_head)
                else:
                    writer.add_tensor(f"blk.{il}.attn_sinks.weight", np.full(shape.n_head, shape.attn_sink, np.float32))
            if shape.is_gemma:
                norm(f"blk.{il}.post_attention_norm.weight")
                norm(f"blk.{il}.post_ffw_norm.weight")
            if shape.arch == "gemma3n":
                gemma3n_layer_tensors(il)
            if shape.arch in ("gemma3", "gemma3n", "gemma4") or (shape.arch in ("lfm2", "qwen35")
                                                                  and not shape.is_recurrent(il)):
                norm(f"blk.{il}.attn_q_norm.weight", dim)
                if shape.has_kv(il):
                    norm(f"blk.{il}.attn_k_norm.weight", dim)
        # LFM2's final norm keeps the name its first converter gave it
        norm("token_embd_norm.weight" if shape.arch == "lfm2" else "output_norm.weight")
        if not shape.is_gemma:  # Gemma ties its output to the token embedding
            matrix("output.weight", shape.n_vocab, shape.n_embd)

    matrix("token_embd.weight", shape.n_vocab, shape.n_embd)
    if shape.arch == "t5":
        t5_tensors()
    else:
        decoder_tensors()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pykvq.devtools.random_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("output", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="pykvq: %(message)s")
    write(SHAPES[args.shape], args.output, args.seed)
    log.info("wrote %s", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
