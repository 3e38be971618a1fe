"""`pykvq convert`: a Hugging Face model to GGUF through llama.cpp's own converter, with the per-layer KV
calibration that needs torch. Installed as ``pykvq.convert``; torch is imported only when calibration runs."""
