"""Hugging Face model folders for the convert tests: a tiny random Llama built from a config, and SmolLM2
made from its GGUF by transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TINY_VOCAB = 512


def tiny_llama(dest: Path, text: Path, n_layer: int = 3, byte_fallback: bool = True) -> Path:
    """A random Llama (head size 32, GQA 2) with a sentencepiece tokenizer trained on ``text`` (with byte tokens
    for what it lacks, unless byte_fallback is off); the weights are fp16-representable, so an f16 GGUF holds
    exactly the same model."""
    import sentencepiece as spm
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    lines = [line for line in text.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines[:4000]), model_prefix=str(dest / "tokenizer"),
                                   vocab_size=TINY_VOCAB, model_type="bpe", byte_fallback=byte_fallback,
                                   minloglevel=2)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=n_layer,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            # larger than the default init, so that attention is not uniform and logits are not all ~0
            p.copy_((p * 4).half().float())
    model.save_pretrained(dest)
    return dest


_FROM_GGUF = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, name, dest = sys.argv[1:]
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
config = loaded.config
# the dequantized weights, as a plain model: one loaded from GGUF refuses to be saved
del config.quantization_config
plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
plain.load_state_dict(loaded.state_dict())
plain.save_pretrained(dest)
tokenizer.save_pretrained(dest)
"""


def from_gguf(gguf: Path, dest: Path) -> Path:
    """The HF form of a GGUF model, made by transformers (gguf_file=) and save_pretrained."""
    # transformers reads GGUF through PyPI's `gguf` (the test extra installs it next to pykvq)
    proc = subprocess.run([sys.executable, "-c", _FROM_GGUF, str(gguf.parent), gguf.name, str(dest)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _skip_a_byte_fallback_byte_level_tokenizer(dest)
    return dest


def _skip_a_byte_fallback_byte_level_tokenizer(folder: Path) -> None:
    """transformers 5.16-5.17 write a GGUF's GPT-2 BPE vocabulary back with byte_fallback on beside its ByteLevel
    pre-tokenizer (5.18 fixed it; measured 2026-11-28): transformers itself tokenizes such a folder as before, but
    llama.cpp's converter takes a byte-fallback BPE for SentencePiece's and writes a vocabulary llama.cpp cannot
    tokenize with (unordered_map::at). The folder then judges transformers, not pykvq's converter."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    pre = tokenizer.get("pre_tokenizer") or {}
    if tokenizer["model"].get("byte_fallback") and pre.get("type") == "ByteLevel":
        import transformers
        pytest.skip(f"transformers {transformers.__version__} wrote this GGUF's GPT-2 BPE back as a byte-fallback "
                    "tokenizer (5.16-5.17; fixed in 5.18): not a folder a model's own save gives")


def tiny_gemma3_projector(dest: Path, n_embd_text: int) -> Path:
    """The multimodal projector (mmproj GGUF) of a tiny random Gemma 3, as llama.cpp's converter writes it with
    --mmproj: a 2-layer SigLIP tower over 64-pixel images in 8-pixel patches, pooled to 16 image tokens of
    ``n_embd_text`` (the language model's width, which libmtmd checks)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    from pykvq import paths

    folder = dest.parent / f"{dest.stem}-hf"
    torch.manual_seed(0)
    text = Gemma3TextConfig(vocab_size=TINY_VOCAB, hidden_size=n_embd_text, intermediate_size=2 * n_embd_text,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    vision = SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                image_size=64, patch_size=8)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=16,
                          image_token_index=TINY_VOCAB - 3, boi_token_index=TINY_VOCAB - 2,
                          eoi_token_index=TINY_VOCAB - 1)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        # transformers starts the projection at zero and the tower near it: every image would look alike
        for name, weight in model.named_parameters():
            if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")) and weight.dim() > 1:
                weight.copy_(torch.randn_like(weight) / weight.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    # transformers 5 saves the SigLIP tower without its vision_model level and with the pooling head Gemma 3 does
    # not use; released checkpoints, which the converter maps, have the one and not the other
    weights = folder / "model.safetensors"
    tensors = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): tensor.contiguous()
               for name, tensor in load_file(weights).items() if not name.startswith("vision_tower.head.")}
    save_file(tensors, weights, metadata={"format": "pt"})
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Gemma3ImageProcessor", "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
         "size": {"height": 64, "width": 64}, "image_seq_length": 16}))
    proc = subprocess.run([sys.executable, str(paths.hf_converter()), str(folder), "--mmproj", "--outtype", "f16",
                           "--outfile", str(dest)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dest
