"""cffi bindings to the built libllama and libggml (with pykvq's C API extension), llama.cpp's log routed into
Python logging, pykvq's ggml type ids, and the pinned llama.cpp's ``gguf`` package on a private import path."""
