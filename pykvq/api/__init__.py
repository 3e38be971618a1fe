"""The Python API: a GGUF model, its contexts (KV cache, logits, sequences, state) and llama.cpp's sampler chain.

``from pykvq import Model, Context, KvConfig, ...`` re-exports what lives here."""
