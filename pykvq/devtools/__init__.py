"""Build and developer tooling: obtaining and patching the pinned upstream (run by CMake at configure time),
the patch-series work tree, and random-weight GGUF models of real shapes for benchmarks."""
